//! Einsum. The output is a sum of products over the index letters; each input's gradient is
//! the einsum of the output gradient with the other inputs, written out to that input's
//! letters:
//!
//! ```text
//! Y = einsum("ij,jk->ik", A, B)     dA = einsum("ik,jk->ij", dY, B)
//!                                   dB = einsum("ik,ij->jk", dY, A)
//! ```
//!
//! A letter of an input that appears nowhere else (neither in the output nor in another
//! input) was summed over that input alone, so its gradient is constant along that axis:
//! the einsum leaves the letter out and the result is expanded back to the input's shape.
//! An ellipsis stands for the same broadcast axes in every term; where an input's own
//! ellipsis axes were broadcast (fewer, or of size 1), its gradient is summed over them.
//!
//! Not supported (a clear error naming the node): a letter repeated within the input whose
//! gradient is wanted (a diagonal), and an ellipsis that the output drops.

use super::super::shapes::Dim;
use super::{Grad, InputGrads};
use crate::ir::builder::attr_string;
use crate::ir::emit::Emit;
use crate::ir::{NodeId, ValueId};
use crate::passes::PassError;

/// One position of a term: an index letter, or the ellipsis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Index {
    Letter(char),
    Ellipsis,
}

/// A parsed equation: the inputs' terms and the output's (explicit or implicit).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Equation {
    pub inputs: Vec<Vec<Index>>,
    pub output: Vec<Index>,
}

fn parse_term(term: &str) -> Result<Vec<Index>, String> {
    let mut out = Vec::new();
    let mut rest = term;
    while let Some(c) = rest.chars().next() {
        if let Some(after) = rest.strip_prefix("...") {
            if out.contains(&Index::Ellipsis) {
                return Err(format!("term '{term}' has two ellipses"));
            }
            out.push(Index::Ellipsis);
            rest = after;
        } else if c.is_ascii_alphabetic() {
            out.push(Index::Letter(c));
            rest = &rest[1..];
        } else {
            return Err(format!("term '{term}' has the character '{c}'"));
        }
    }
    Ok(out)
}

impl Equation {
    pub fn parse(equation: &str) -> Result<Equation, String> {
        let compact: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
        let (lhs, rhs) = match compact.split_once("->") {
            Some((l, r)) => (l, Some(r)),
            None => (compact.as_str(), None),
        };
        let inputs = lhs
            .split(',')
            .map(parse_term)
            .collect::<Result<Vec<_>, _>>()?;
        let output = match rhs {
            Some(r) => parse_term(r)?,
            // Implicit form: the ellipsis first, then the letters that appear once, sorted.
            None => {
                let all: Vec<Index> = inputs.iter().flatten().copied().collect();
                let mut once: Vec<char> = all
                    .iter()
                    .filter_map(|i| match i {
                        Index::Letter(c) if all.iter().filter(|j| *j == i).count() == 1 => Some(*c),
                        _ => None,
                    })
                    .collect();
                once.sort_unstable();
                let ellipsis = all.contains(&Index::Ellipsis).then_some(Index::Ellipsis);
                ellipsis
                    .into_iter()
                    .chain(once.into_iter().map(Index::Letter))
                    .collect()
            }
        };
        Ok(Equation { inputs, output })
    }

    /// The output's dims from the inputs' (`None` where an input's rank is unknown).
    pub fn output_dims(&self, inputs: &[Option<Vec<Dim>>]) -> Option<Vec<Dim>> {
        let mut letters: Vec<(char, Dim)> = Vec::new();
        let mut ellipsis: Vec<Dim> = Vec::new();
        for (term, dims) in self.inputs.iter().zip(inputs) {
            let dims = dims.as_ref()?;
            let letters_in_term = term.iter().filter(|i| **i != Index::Ellipsis).count();
            let ellipsis_rank = dims.len().checked_sub(letters_in_term)?;
            let mut at = 0;
            for index in term {
                match index {
                    Index::Letter(c) => {
                        let d = dims[at].clone();
                        match letters.iter_mut().find(|(l, _)| l == c) {
                            Some((_, known)) if known.known().is_none() => *known = d,
                            Some(_) => {}
                            None => letters.push((*c, d)),
                        }
                        at += 1;
                    }
                    Index::Ellipsis => {
                        let own = &dims[at..at + ellipsis_rank];
                        ellipsis = broadcast_dims(&ellipsis, own);
                        at += ellipsis_rank;
                    }
                }
            }
        }
        let mut out = Vec::new();
        for index in &self.output {
            match index {
                Index::Letter(c) => out.push(
                    letters
                        .iter()
                        .find(|(l, _)| l == c)
                        .map_or(Dim::Unknown, |(_, d)| d.clone()),
                ),
                Index::Ellipsis => out.extend(ellipsis.iter().cloned()),
            }
        }
        Some(out)
    }
}

/// Numpy broadcasting of two dim lists, right-aligned.
fn broadcast_dims(a: &[Dim], b: &[Dim]) -> Vec<Dim> {
    let rank = a.len().max(b.len());
    (0..rank)
        .map(|i| {
            let pick = |v: &[Dim]| (i + v.len()).checked_sub(rank).map(|j| v[j].clone());
            match (pick(a), pick(b)) {
                (Some(x), None) | (None, Some(x)) => x,
                (Some(Dim::Known(1)), Some(y)) => y,
                (Some(x), Some(_)) => x,
                (None, None) => Dim::Unknown,
            }
        })
        .collect()
}

fn term_text(term: &[Index]) -> String {
    term.iter()
        .map(|i| match i {
            Index::Letter(c) => c.to_string(),
            Index::Ellipsis => "...".into(),
        })
        .collect()
}

pub fn einsum(
    cx: &mut Grad<'_>,
    node: NodeId,
    dys: &[Option<ValueId>],
    wants: &[bool],
) -> Result<InputGrads, PassError> {
    let text = cx
        .string_attr(node, "equation")?
        .ok_or_else(|| cx.error(node, "attribute 'equation' is missing".into()))?;
    let eq =
        Equation::parse(&text).map_err(|m| cx.error(node, format!("equation '{text}': {m}")))?;
    let operands: Vec<ValueId> = (0..eq.inputs.len())
        .map(|i| cx.input(node, i))
        .collect::<Result<_, _>>()?;
    let dy = cx.dy(node, dys, 0)?;
    let y = cx.forward_output(node, 0)?;
    let mut out = vec![None; operands.len()];
    for (i, term) in eq.inputs.iter().enumerate() {
        if !super::wanted(wants, i) {
            continue;
        }
        out[i] = Some(operand_grad(
            cx, node, &eq, &operands, i, term, dy, y, &text,
        )?);
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn operand_grad(
    cx: &mut Grad<'_>,
    node: NodeId,
    eq: &Equation,
    operands: &[ValueId],
    i: usize,
    term: &[Index],
    dy: ValueId,
    y: ValueId,
    text: &str,
) -> Result<ValueId, PassError> {
    let x = operands[i];
    let h = format!("{}_grad", cx.model().name(x));
    for (k, index) in term.iter().enumerate() {
        if term[..k].contains(index) {
            return Err(cx.error(
                node,
                format!(
                    "equation '{text}': input {i} repeats an index (a diagonal); its gradient is not supported"
                ),
            ));
        }
    }
    let has_ellipsis = term.contains(&Index::Ellipsis);
    if has_ellipsis && !eq.output.contains(&Index::Ellipsis) {
        return Err(cx.error(
            node,
            format!(
                "equation '{text}': the output drops the ellipsis of input {i}; its gradient is not supported"
            ),
        ));
    }
    // Letters seen elsewhere (the output or another input) come back from the einsum;
    // the others were summed over this input alone.
    let elsewhere = |index: &Index| {
        eq.output.contains(index)
            || eq
                .inputs
                .iter()
                .enumerate()
                .any(|(j, t)| j != i && t.contains(index))
    };
    let kept: Vec<Index> = term.iter().copied().filter(|ix| elsewhere(ix)).collect();
    let mut terms = vec![term_text(&eq.output)];
    let mut inputs = vec![dy];
    for (j, t) in eq.inputs.iter().enumerate() {
        if j != i {
            terms.push(term_text(t));
            inputs.push(operands[j]);
        }
    }
    // ONNX Runtime's Einsum keeps an ellipsis its inputs have: an input without one gets
    // the gradient with the ellipsis axes in front, then summed away.
    let others_broadcast = !has_ellipsis && eq.output.contains(&Index::Ellipsis);
    let mut out_term = kept.clone();
    if others_broadcast {
        out_term.insert(0, Index::Ellipsis);
    }
    let equation = format!("{}->{}", terms.join(","), term_text(&out_term));
    let mut g = cx.op(
        "Einsum",
        &inputs,
        vec![attr_string("equation", &equation)],
        &h,
    );
    if others_broadcast {
        let rank = cx.need_rank(node, y)?;
        let letters = eq.output.len() - 1;
        let leading: Vec<i64> = (0..rank.saturating_sub(letters) as i64).collect();
        if !leading.is_empty() {
            g = cx.reduce("ReduceSum", g, &leading, false, &h);
        }
    }

    if has_ellipsis {
        g = sum_broadcast_ellipsis(cx, node, g, x, y, term, &eq.output, &kept)?;
    }
    if kept.len() < term.len() {
        // Put the summed-away axes back (size 1), then spread the gradient along them.
        let len = term.len() as i64;
        let after_ellipsis = |k: usize| {
            term.iter()
                .position(|ix| *ix == Index::Ellipsis)
                .is_some_and(|e| k > e)
        };
        let axes: Vec<i64> = term
            .iter()
            .enumerate()
            .filter(|(_, ix)| !elsewhere(ix))
            .map(|(k, _)| {
                if after_ellipsis(k) {
                    k as i64 - len
                } else {
                    k as i64
                }
            })
            .collect();
        let unsqueezed = cx.unsqueeze(g, &axes, &h);
        g = cx.expand_to(unsqueezed, x, &h);
    } else {
        let facts = cx.facts(x);
        cx.shapes.set(g, facts);
    }
    Ok(g)
}

/// Where `x`'s ellipsis axes were broadcast against the others' (fewer axes, or size 1
/// where the output's are not), sums the gradient `g` (whose ellipsis axes are the
/// output's) over them.
#[allow(clippy::too_many_arguments)]
fn sum_broadcast_ellipsis(
    cx: &mut Grad<'_>,
    node: NodeId,
    g: ValueId,
    x: ValueId,
    y: ValueId,
    term: &[Index],
    output: &[Index],
    kept: &[Index],
) -> Result<ValueId, PassError> {
    let (Some(xd), Some(yd)) = (cx.facts(x).dims, cx.facts(y).dims) else {
        return Err(cx.error(
            node,
            format!(
                "the gradient of an einsum with an ellipsis needs the ranks of '{}' and '{}', which are neither declared nor derivable",
                cx.model().name(x),
                cx.model().name(y)
            ),
        ));
    };
    let ellipsis_of = |dims: &[Dim], t: &[Index]| -> Option<Vec<Dim>> {
        let start = t.iter().position(|ix| *ix == Index::Ellipsis)?;
        let rank = dims.len().checked_sub(t.len() - 1)?;
        Some(dims.get(start..start + rank)?.to_vec())
    };
    let (Some(xe), Some(ye)) = (ellipsis_of(&xd, term), ellipsis_of(&yd, output)) else {
        return Err(cx.error(node, "the einsum's ranks do not fit its equation".into()));
    };
    if xe.len() != ye.len() {
        return Err(cx.error(
            node,
            "the einsum's ellipses stand for different numbers of axes (ONNX requires one)".into(),
        ));
    }
    // In g the ellipsis axes start where the kept letters put the ellipsis.
    let start = kept
        .iter()
        .position(|ix| *ix == Index::Ellipsis)
        .unwrap_or(0);
    let ones: Vec<i64> = xe
        .iter()
        .zip(&ye)
        .enumerate()
        .filter(|(_, (xd, yd))| **xd == Dim::Known(1) && **yd != Dim::Known(1))
        .map(|(k, _)| (start + k) as i64)
        .collect();
    if ones.is_empty() {
        return Ok(g);
    }
    let h = format!("{}_grad", cx.model().name(x));
    Ok(cx.reduce("ReduceSum", g, &ones, true, &h))
}
