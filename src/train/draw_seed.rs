//! `train --draw-seed SEED`: every node of a session that draws random numbers (a training
//! Dropout's mask, `RandomNormal`/`RandomUniform` and their `Like` forms, `Bernoulli`,
//! `Multinomial`, ONNX Runtime's `BiasDropout`, `BitmaskDropout`, `BiasSoftmaxDropout`)
//! gets a `seed` attribute, so that two runs with the same seed draw the same numbers.
//!
//! Without one, ONNX Runtime seeds each such kernel from the clock or the OS and tract from
//! the OS: a run with dropout cannot be repeated. With one, each kernel keeps its own
//! generator, seeded once when the session is made, and advances it on every run (ONNX
//! Runtime's `RandomGenerator::NextSeed` per `Compute`; tract's op state, which the engine
//! keeps across runs): every micro-step draws anew, and the sequence is the seed's.
//!
//! Each node's seed is derived from the run's seed, the data-parallel rank (0 alone; ranks
//! seeded alike would draw the same masks for rows of different micro-batches), the session
//! (the split runner's window start, accumulate and apply specialisations each run the
//! forward pass, and with one seed they would draw the same masks at the same count of
//! their own runs) and the node's place in the graph, so no two generators of a run start
//! alike. `--draw-seed` seeds every
//! drawing node, over any seed the model gives. Without it, a node the model seeds itself
//! (its author's choice) keeps that seed in the whole step, and in each specialisation of
//! the split runner draws from it mixed with the session (and the rank): kept verbatim there, the window
//! start's, the accumulate's and the apply's generators would start alike, and the
//! micro-steps of a window would draw the same masks.
//!
//! A resumed run seeds its sessions the same way, so from the resume point on it draws what
//! the first run drew from its start, not what the first run would have drawn next: it is
//! reproducible (the same resume point gives the same run), not a continuation.

use super::Session;
use crate::proto::attribute_proto::AttributeType;
use crate::proto::{AttributeProto, GraphProto, ModelProto, NodeProto};

/// The ops that draw, by domain, and whether their `seed` attribute is an int (else a float).
const DRAWING: &[(&str, &str, SeedKind)] = &[
    ("", "Dropout", SeedKind::Int),
    ("", "RandomNormal", SeedKind::Float),
    ("", "RandomUniform", SeedKind::Float),
    ("", "RandomNormalLike", SeedKind::Float),
    ("", "RandomUniformLike", SeedKind::Float),
    ("", "Bernoulli", SeedKind::Float),
    ("", "Multinomial", SeedKind::Float),
    ("com.microsoft", "BiasDropout", SeedKind::Int),
    ("com.microsoft", "BitmaskDropout", SeedKind::Int),
    ("com.microsoft", "BiasSoftmaxDropout", SeedKind::Int),
];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SeedKind {
    Int,
    /// A float attribute that ONNX Runtime converts to a 32-bit unsigned integer and tract
    /// reads as a float: kept below 2^24, where every integer is exact in float32.
    Float,
}

/// Seeds the drawing nodes of `model` (at any depth: If branches, Loop and Scan bodies) as
/// session `role` of rank `rank` of a run (0 alone): from `seed` when given
/// (`--draw-seed`, over any seed the model has), else only the nodes the model seeds itself,
/// and only where the session is not the whole step (see the module's comment); returns how
/// many nodes it seeded. Each rank of data-parallel training seeds from its own stream
/// ([`for_rank`]), the author's seeds too: ranks drawing alike would give rows of different
/// micro-batches the same masks, which one process never does.
pub(crate) fn seed_draws(
    model: &mut ModelProto,
    seed: Option<u64>,
    rank: usize,
    role: Session,
) -> usize {
    let Some(graph) = model.graph.as_mut() else {
        return 0;
    };
    // The session's index is part of every seed: it must not change without reason.
    let session = mix(role.index() as u64 + 1);
    let derive = |existing: Option<u64>, place: u64| match (seed, existing) {
        (Some(seed), _) => Some(mix(mix(for_rank(seed, rank)) ^ session ^ place)),
        // The author's seed, told apart per session but not per node: two nodes the author
        // gave one seed still draw alike within a session.
        (None, Some(own)) if role != Session::Whole => {
            Some(mix(mix(for_rank(own, rank)) ^ session))
        }
        _ => None,
    };
    seed_graph(graph, 0, &derive)
}

/// The seed rank `rank` of a data-parallel job seeds its sessions from: each rank draws
/// its own masks (with one seed they would draw the same ones for different rows); rank 0
/// the run's seed itself.
fn for_rank(seed: u64, rank: usize) -> u64 {
    match rank {
        0 => seed,
        rank => mix(seed ^ mix(rank as u64)),
    }
}

/// Whether `model` has a node that draws random numbers (seeded or not).
pub fn draws(model: &ModelProto) -> bool {
    any_draw(model, &|_| true)
}

/// Whether [`seed_draws`] would change `model` as session `role` with `seed`.
pub(crate) fn would_seed(model: &ModelProto, seed: Option<u64>, role: Session) -> bool {
    match (seed, role) {
        (Some(_), _) => draws(model),
        (None, Session::Whole) => false,
        (None, _) => any_draw(model, &|node| own_seed(node).is_some()),
    }
}

fn any_draw(model: &ModelProto, wanted: &dyn Fn(&NodeProto) -> bool) -> bool {
    fn any(graph: &GraphProto, wanted: &dyn Fn(&NodeProto) -> bool) -> bool {
        graph.node.iter().any(|node| {
            (kind_of(node.domain(), node.op_type()).is_some() && wanted(node))
                || node
                    .attribute
                    .iter()
                    .any(|a| subgraphs(a).any(|g| any(g, wanted)))
        })
    }
    model.graph.as_ref().is_some_and(|g| any(g, wanted))
}

/// The `seed` a node carries, as bits (an int's value, a float's bits).
fn own_seed(node: &NodeProto) -> Option<u64> {
    let attribute = node.attribute.iter().find(|a| a.name() == "seed")?;
    attribute
        .i
        .map(|i| i as u64)
        .or(attribute.f.map(|f| f.to_bits() as u64))
}

fn seed_graph(
    graph: &mut GraphProto,
    path: u64,
    derive: &dyn Fn(Option<u64>, u64) -> Option<u64>,
) -> usize {
    let mut seeded = 0;
    for (index, node) in graph.node.iter_mut().enumerate() {
        // The node's place: its index in its body, the body's place, its op and its name.
        let place = mix(path
            ^ mix(index as u64 + 1)
            ^ bytes_hash(node.op_type().as_bytes())
            ^ mix(bytes_hash(node.name().as_bytes())));
        if let Some(kind) = kind_of(node.domain(), node.op_type()) {
            if let Some(value) = derive(own_seed(node), place) {
                node.attribute.retain(|a| a.name() != "seed");
                node.attribute.push(seed_attribute(kind, value));
                seeded += 1;
            }
        }
        for (a, attribute) in node.attribute.iter_mut().enumerate() {
            let attribute_path = mix(place ^ (a as u64 + 1));
            if let Some(g) = attribute.g.as_mut() {
                seeded += seed_graph(g, mix(attribute_path), derive);
            }
            for (b, g) in attribute.graphs.iter_mut().enumerate() {
                seeded += seed_graph(g, mix(attribute_path ^ mix(b as u64 + 1)), derive);
            }
        }
    }
    seeded
}

fn subgraphs(attribute: &AttributeProto) -> impl Iterator<Item = &GraphProto> {
    attribute.g.iter().chain(attribute.graphs.iter())
}

fn kind_of(domain: &str, op: &str) -> Option<SeedKind> {
    let domain = crate::ir::normalize_domain(domain);
    DRAWING
        .iter()
        .find(|(d, o, _)| *d == domain && *o == op)
        .map(|(_, _, kind)| *kind)
}

fn seed_attribute(kind: SeedKind, value: u64) -> AttributeProto {
    match kind {
        // Non-negative: ONNX Runtime's CPU Dropout takes it as an unsigned seed.
        SeedKind::Int => AttributeProto {
            name: Some("seed".into()),
            r#type: Some(AttributeType::Int as i32),
            i: Some((value >> 1) as i64),
            ..Default::default()
        },
        SeedKind::Float => AttributeProto {
            name: Some("seed".into()),
            r#type: Some(AttributeType::Float as i32),
            f: Some((value >> 40) as f32),
            ..Default::default()
        },
    }
}

/// SplitMix64's finaliser: a bijection of u64 whose outputs of nearby inputs look unrelated.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a of `bytes`.
fn bytes_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seeds(model: &ModelProto) -> Vec<(String, Option<i64>, Option<f32>)> {
        fn walk(graph: &GraphProto, out: &mut Vec<(String, Option<i64>, Option<f32>)>) {
            for node in &graph.node {
                if let Some(seed) = node.attribute.iter().find(|a| a.name() == "seed") {
                    out.push((node.name().to_string(), seed.i, seed.f));
                }
                for a in &node.attribute {
                    subgraphs(a).for_each(|g| walk(g, out));
                }
            }
        }
        let mut out = Vec::new();
        walk(model.graph.as_ref().unwrap(), &mut out);
        out
    }

    fn model() -> ModelProto {
        crate::ir::text::parse_model(
            r#"<ir_version: 8, opset_import: ["" : 17]>
            g (float[4] x, bool c) => (float[4] y) {
              [d1] a, m = Dropout (x)
              [u1] u = RandomUniformLike (a)
              [kept] k = RandomNormalLike <seed = 5.0> (u)
              [branch] y = If (c) <
                then_branch = t () => (float[4] yt) { [d2] yt = Dropout (k) },
                else_branch = e () => (float[4] ye) { [d3] ye, me = Dropout (k) }
              >
            }"#,
        )
        .unwrap()
    }

    /// With a run's seed every drawing node is seeded, at any depth, the model's own seed
    /// replaced; the same seed and session give the same seeds, and another seed or session
    /// others, all distinct.
    #[test]
    fn every_draw_gets_a_seed_of_its_own_and_the_run_s() {
        let mut a = model();
        assert!(draws(&a) && would_seed(&a, Some(7), Session::Whole));
        assert_eq!(seed_draws(&mut a, Some(7), 0, Session::Accumulate), 5);
        let seen = seeds(&a);
        let names: Vec<&str> = seen.iter().map(|(n, _, _)| n.as_str()).collect();
        assert_eq!(names, ["d1", "u1", "kept", "d2", "d3"]);
        assert!(
            seen[2].2.is_some_and(|f| f != 5.0),
            "--draw-seed decides every draw"
        );
        assert!(seen[0].1.is_some_and(|i| i >= 0));
        assert!(seen[1]
            .2
            .is_some_and(|f| f < 16_777_216.0 && f.fract() == 0.0));

        let mut again = model();
        seed_draws(&mut again, Some(7), 0, Session::Accumulate);
        assert_eq!(
            seeds(&again),
            seen,
            "the same seed and session: the same seeds"
        );

        let ints = |m: &ModelProto| -> Vec<i64> { seeds(m).iter().filter_map(|s| s.1).collect() };
        let mut other_role = model();
        seed_draws(&mut other_role, Some(7), 0, Session::Apply);
        let mut other_seed = model();
        seed_draws(&mut other_seed, Some(8), 0, Session::Accumulate);
        let mut all: Vec<i64> = [&a, &other_role, &other_seed]
            .iter()
            .flat_map(|m| ints(m))
            .collect();
        assert_eq!(all.len(), 9);
        all.sort_unstable();
        all.dedup();
        assert_eq!(
            all.len(),
            9,
            "every Dropout of the three seedings has its own seed"
        );
    }

    /// Without a run's seed only what the model seeds itself changes, and only in the split
    /// runner's sessions, each its own way; the whole step keeps the author's seed.
    #[test]
    fn the_model_s_own_seeds_are_told_apart_per_session() {
        let mut whole = model();
        assert!(!would_seed(&whole, None, Session::Whole));
        assert_eq!(seed_draws(&mut whole, None, 0, Session::Whole), 0);
        assert_eq!(seeds(&whole), [("kept".to_string(), None, Some(5.0))]);

        let own = |role| {
            let mut m = model();
            assert!(would_seed(&m, None, role));
            assert_eq!(seed_draws(&mut m, None, 0, role), 1, "{role:?}");
            let seen = seeds(&m);
            assert_eq!(seen.len(), 1, "{role:?}: unseeded draws stay the engine's");
            seen[0].2.unwrap()
        };
        let sessions = [
            own(Session::WindowStart),
            own(Session::Accumulate),
            own(Session::Apply),
        ];
        assert!(sessions.iter().all(|&f| f != 5.0));
        assert!(
            sessions[0] != sessions[1] && sessions[1] != sessions[2] && sessions[0] != sessions[2]
        );
        assert_eq!(
            own(Session::Apply),
            sessions[2],
            "the same run, the same seed"
        );

        let plain = crate::ir::text::parse_model(
            r#"<ir_version: 8, opset_import: ["" : 17]>
            g (float[4] x) => (float[4] y) { y, m = Dropout (x) }"#,
        )
        .unwrap();
        assert!(!would_seed(&plain, None, Session::Apply));
    }

    /// Rank 0 seeds as a single process does; every other rank from a seed of its own.
    #[test]
    fn each_rank_draws_from_its_own_seed() {
        assert_eq!(for_rank(7, 0), 7);
        let mut seeds: Vec<u64> = (0..64).map(|rank| for_rank(7, rank)).collect();
        seeds.extend((0..64).map(|rank| for_rank(8, rank)));
        seeds.sort_unstable();
        seeds.dedup();
        assert_eq!(seeds.len(), 128);
    }

    /// Ranks of data-parallel training seed apart, the model's own seeds too (else every
    /// rank would draw the same masks for rows of different micro-batches); rank 0 seeds
    /// as one process does.
    #[test]
    fn ranks_seed_apart_whoever_gave_the_seed() {
        let seeds_of = |seed: Option<u64>, rank: usize| {
            let mut m = model();
            seed_draws(&mut m, seed, rank, Session::Accumulate);
            seeds(&m)
        };
        for seed in [Some(7), None] {
            let (zero, one, two) = (seeds_of(seed, 0), seeds_of(seed, 1), seeds_of(seed, 2));
            assert!(!zero.is_empty());
            assert!(zero != one && one != two && zero != two, "{seed:?}");
            assert_eq!(
                seeds_of(seed, 1),
                one,
                "{seed:?}: the same rank, the same seeds"
            );
        }
        // Rank 0 is the single process: its seeds are those of the process (`for_rank`'s
        // identity), with or without a run's seed.
        assert_eq!(for_rank(7, 0), 7);
        assert_eq!(
            for_rank(5.0f32.to_bits() as u64, 0),
            5.0f32.to_bits() as u64
        );
    }

    #[test]
    fn a_model_without_draws_says_so() {
        let model = crate::ir::text::parse_model(
            r#"<ir_version: 8, opset_import: ["" : 17]>
            g (float[4] x) => (float[4] y) { y = Relu (x) }"#,
        )
        .unwrap();
        assert!(!draws(&model));
    }
}
