//! Weight gradients kept as their operands until the window needs their sum.
//!
//! In an accumulating micro-step, `AccumulateProduct` adds a weight gradient `Aᵀ·B` into its
//! accumulator (`fused_ops::product`): one pass over the accumulator, read and written, per
//! micro-step, for a product whose operands are `k` rows each (the micro-batch). Kept
//! instead (`A` and `B` copied: `k·(m + n)` floats against the accumulator's `m·n`), the
//! products of a window's accumulating micro-steps are added by the last of them in one
//! pass (`fused_ops::accumulate_products`). Each element takes the same operations in the
//! same order, `((acc + s_1) + s_2) + ...`, so the bits are the standard ops'; the
//! accumulator is read and written once a window instead of once a micro-step.
//!
//! The window's first micro-step keeps its product too (the window-start session's
//! `AccumulateProduct` with `overwrites`, `train::window_start`): its accumulator holds
//! nothing yet, so the kept products then sum from nothing, `(s_1 + s_2) + ...`, the first
//! written as the window start's `Gemm` writes it and the buffer never read
//! ([`SumFrom::Nothing`]): no pass over the accumulator until the sum, which writes it
//! without reading it.
//!
//! Where the apply's fused update (AdamW, or SGD with or without momentum) reads the
//! accumulator and nothing else does (`passes::fuse::apply_kept_sum`), the last
//! accumulating micro-step keeps its product too and the update adds the kept products
//! itself, rows at a time as it reads them (`engine::ort_ops`): the accumulator is then not written in the window at all, and the
//! apply reads the sum from its own thread's memory instead of the accumulator's. The
//! realistic MLP (1.9M parameters, K 4) at B 8: the window 3% (one thread) and 5% (two)
//! faster in the medians (benches/README.md, "Run AN"). Adaptive gradient clipping and loss
//! scaling read the window's gradient whole before the update: there the last accumulating
//! micro-step makes the sum, as before.
//!
//! Between those micro-steps the accumulator the engine holds is behind: its value is the
//! buffer plus the kept products, in order (or the kept products alone, from a window's
//! first). Whoever reads it from outside the sessions adds
//! them first ([`DeferredProducts::add_kept`]): the trainer's host copies (`state`,
//! `host_value`, checkpoints), and the held buffer itself before a session other than the
//! accumulating one runs (a window ended early by a flush or a lowered K), but for what the
//! apply's own updates add. Loading a state forgets them ([`DeferredProducts::forget`]).
//!
//! One table per trainer, shared by its window's sessions' kernels (through
//! `SessionOptions::deferred_products`) and the trainer; the kernels find their
//! accumulator's entry by its state name (the node's `accumulator` attribute).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use crate::fused_ops::{
    accumulate_products, Io, ProductLayout, ProductOperands, ProductShape, SumFrom,
};

/// The most rows (micro-batch samples) kept for one accumulator: the pass that adds them
/// reads every kept product's `B` once per group of the accumulator's rows, which at 64
/// rows of 1024 columns is 256 KiB, within a core's L2. (128 against 64 on the realistic
/// MLP at B 48 and 64, Zen 3: one or two points either way; benches/README.md, "Run AM".)
const MOST_KEPT_ROWS: usize = 64;

/// The kept operands may take at most this share of the accumulator's size (`1 / 4`): past
/// it, copying them costs a good part of the pass they save (a product of more rows than
/// its accumulator's sides is no rank-k update).
const MOST_KEPT_SHARE: usize = 4;

/// The kept products of a trainer's accumulators, by accumulator (state input name).
#[derive(Default)]
pub struct DeferredProducts {
    kept: Mutex<BTreeMap<String, Kept>>,
    /// Set by the trainer before each accumulating run: the next micro-step applies, so
    /// this run adds every kept product (and its own) into the accumulators.
    sum_now: AtomicBool,
}

impl std::fmt::Debug for DeferredProducts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeferredProducts")
            .field("kept_for", &self.kept_names())
            .finish()
    }
}

impl DeferredProducts {
    /// Whether the coming accumulating run must leave the accumulators whole.
    pub fn set_sum_now(&self, sum_now: bool) {
        self.sum_now.store(sum_now, Ordering::Relaxed);
    }

    pub(crate) fn sum_now(&self) -> bool {
        self.sum_now.load(Ordering::Relaxed)
    }

    /// The accumulators that have products kept.
    pub fn kept_names(&self) -> Vec<String> {
        self.table()
            .iter()
            .filter(|(_, kept)| !kept.is_empty())
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Notes that the apply session's optimizer update of accumulator `name` adds the
    /// products kept for it as it reads it (`passes::fuse::apply_kept_sum`): the window's
    /// last accumulating micro-step may then keep its product too.
    pub(crate) fn set_summed_at_apply(&self, name: &str) {
        self.table()
            .entry(name.to_string())
            .or_default()
            .summed_at_apply = true;
    }

    /// Whether the apply's update of accumulator `name` adds its kept products.
    pub fn summed_at_apply(&self, name: &str) -> bool {
        self.table()
            .get(name)
            .is_some_and(|kept| kept.summed_at_apply)
    }

    /// Whether accumulator `name` has products kept (its held value is behind).
    pub fn is_behind(&self, name: &str) -> bool {
        self.table().get(name).is_some_and(|kept| !kept.is_empty())
    }

    /// Adds the products kept for accumulator `name` to `acc`, its value as held, in the
    /// order they were kept (or writes their sum over it, when they start from nothing),
    /// and forgets them when `forget`. `acc` is the whole accumulator.
    pub fn add_kept(&self, name: &str, acc: &mut [f32], forget: bool) {
        let mut table = self.table();
        let Some(kept) = table.get_mut(name) else {
            return;
        };
        if kept.is_empty() {
            return;
        }
        let from = kept.from();
        let operands = kept.operands(None);
        accumulate_products(&operands, (0, from), Io::InPlace([acc]));
        if forget {
            kept.clear();
        }
    }

    /// Forgets every kept product (the accumulators were replaced).
    pub fn forget(&self) {
        for kept in self.table().values_mut() {
            kept.clear();
        }
    }

    /// Accumulator `name`'s entry, taken out for a kernel's run (the table is not held
    /// locked while the kernel's tasks run); [`Self::put_back`] returns it.
    pub(crate) fn take(&self, name: &str) -> Kept {
        self.table().remove(name).unwrap_or_default()
    }

    pub(crate) fn put_back(&self, name: &str, kept: Kept) {
        self.table().insert(name.to_string(), kept);
    }

    fn table(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Kept>> {
        // A kernel that panicked left at worst an entry out of the table: what is in it is
        // whole.
        self.kept
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// The products kept for one accumulator, and memory kept for the next ones.
#[derive(Default)]
pub(crate) struct Kept {
    /// The kept products first (`len` of them), then spare buffers of earlier windows.
    pairs: Vec<KeptPair>,
    len: usize,
    /// What the kept products sum from: the held buffer, or nothing (the first was a
    /// window's first product, its buffer not yet written).
    from: SumFrom,
    /// Whether the accumulating session's kernel for this accumulator updates it in place
    /// (as of its last run): only then is a window's first product kept, for that kernel
    /// to sum. (With the host's updates, or apart, nothing would sum it in the window; a
    /// discarded micro-step apart puts the accumulator's old value back beside the table.)
    summed_in_place: bool,
    /// Whether the apply session's update adds the kept products as it reads the
    /// accumulator ([`DeferredProducts::set_summed_at_apply`]).
    summed_at_apply: bool,
    /// One layout per product added at once (the kept ones and a kernel's own).
    layouts: Vec<ProductLayout>,
}

struct KeptPair {
    shape: ProductShape,
    a: Vec<f32>,
    b: Vec<f32>,
}

/// One product's operands `A` `[k, m]` and `B` `[k, n]` and its shape, as given.
pub(crate) type ProductPair<'a> = (&'a [f32], &'a [f32], ProductShape);

impl Kept {
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// What the kept products sum from.
    pub(crate) fn from(&self) -> SumFrom {
        self.from
    }

    /// Notes whether the accumulating session's kernel updates this accumulator in place.
    pub(crate) fn set_summed_in_place(&mut self, in_place: bool) {
        self.summed_in_place = in_place;
    }

    /// Whether a window's first product may be kept (see the field).
    pub(crate) fn first_may_wait(&self) -> bool {
        self.summed_in_place
    }

    /// Whether the apply adds the kept products (see the field).
    pub(crate) fn summed_at_apply(&self) -> bool {
        self.summed_at_apply
    }

    /// The accumulator's sides `(m, n)` as the kept products have them (none kept: `None`).
    pub(crate) fn sides(&self) -> Option<(usize, usize)> {
        self.kept().first().map(|p| (p.shape.m, p.shape.n))
    }

    fn kept(&self) -> &[KeptPair] {
        &self.pairs[..self.len]
    }

    /// Whether a product of `shape` may be kept beside those kept (the bounds above); a
    /// product of another accumulator shape never may.
    pub(crate) fn has_room_for(&self, shape: ProductShape) -> bool {
        let kept = self.kept();
        let same_sides = kept
            .iter()
            .all(|p| (p.shape.m, p.shape.n) == (shape.m, shape.n));
        let rows = kept.iter().map(|p| p.shape.k).sum::<usize>() + shape.k;
        let floats = rows.saturating_mul(shape.m + shape.n);
        same_sides
            && rows <= MOST_KEPT_ROWS
            && floats <= shape.m.saturating_mul(shape.n) / MOST_KEPT_SHARE
    }

    /// Keeps a window's first product, the accumulator's whole value from now on (its
    /// buffer is not read): what was kept before is forgotten.
    pub(crate) fn keep_first(&mut self, a: &[f32], b: &[f32], shape: ProductShape) {
        self.clear();
        self.from = SumFrom::Nothing;
        self.keep(a, b, shape);
    }

    /// Keeps a copy of the product's operands (`a` is `[k, m]`, `b` `[k, n]`).
    pub(crate) fn keep(&mut self, a: &[f32], b: &[f32], shape: ProductShape) {
        if self.len == self.pairs.len() {
            self.pairs.push(KeptPair {
                shape,
                a: Vec::new(),
                b: Vec::new(),
            });
        }
        let pair = &mut self.pairs[self.len];
        pair.shape = shape;
        pair.a.clear();
        pair.a.extend_from_slice(a);
        pair.b.clear();
        pair.b.extend_from_slice(b);
        self.len += 1;
    }

    /// The kept products, then `own` (a kernel's own product) when given, laid out for the
    /// kernel in this entry's layouts.
    pub(crate) fn operands<'a>(
        &'a mut self,
        own: Option<ProductPair<'a>>,
    ) -> Vec<ProductOperands<'a>> {
        let Kept {
            pairs,
            len,
            layouts,
            ..
        } = self;
        let count = *len + usize::from(own.is_some());
        if layouts.len() < count {
            layouts.resize_with(count, ProductLayout::default);
        }
        let operands = pairs[..*len]
            .iter()
            .map(|p| (p.a.as_slice(), p.b.as_slice(), p.shape))
            .chain(own);
        layouts
            .iter_mut()
            .zip(operands)
            .map(|(layout, (a, b, shape))| layout.operands(a, b, shape))
            .collect()
    }

    /// Forgets the kept products (their buffers stay for the next window).
    pub(crate) fn clear(&mut self) {
        self.len = 0;
        self.from = SumFrom::Accumulator;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused_ops::accumulate_product;

    fn values(seed: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + 1) * (seed * 7919 + 13)) % 1013) as f32 / 509.0 - 1.0)
            .collect()
    }

    /// Kept products added to a held value give what adding each in turn gives, bit for
    /// bit; forgetting them leaves the value as held; the bounds refuse a product past the
    /// rows, past the share, and of other sides.
    #[test]
    fn kept_products_add_up_as_in_turn_and_within_bounds() {
        let (m, n) = (200, 120);
        let table = DeferredProducts::default();
        let acc = values(1, m * n);
        let mut want = acc.clone();
        let mut kept = table.take("w");
        for (p, k) in [3usize, 8, 1].into_iter().enumerate() {
            let shape = ProductShape { k, m, n };
            let (a, b) = (values(2 + p, k * m), values(5 + p, k * n));
            assert!(kept.has_room_for(shape));
            kept.keep(&a, &b, shape);
            accumulate_product(&a, &b, shape, 0, Io::InPlace([&mut want]));
        }
        table.put_back("w", kept);
        assert_eq!(table.kept_names(), ["w"]);
        let mut got = acc.clone();
        table.add_kept("w", &mut got, false);
        assert!(got
            .iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits()));
        let mut again = acc.clone();
        table.add_kept("w", &mut again, true);
        assert_eq!(again, got);
        assert!(table.kept_names().is_empty());
        let mut untouched = acc.clone();
        table.add_kept("w", &mut untouched, true);
        assert_eq!(untouched, acc);

        // A window's first product kept: the value is the kept products alone, the buffer
        // (NaN here) not read; the first written as it is (`+0 + s` would lose a `-0`).
        let mut kept = table.take("w");
        let mut want = vec![0f32; m * n];
        for (p, k) in [2usize, 5].into_iter().enumerate() {
            let shape = ProductShape { k, m, n };
            let (a, b) = (values(8 + p, k * m), values(9 + p, k * n));
            match p {
                0 => {
                    kept.keep_first(&a, &b, shape);
                    ProductLayout::default()
                        .operands(&a, &b, shape)
                        .write(0, &mut want);
                }
                _ => {
                    kept.keep(&a, &b, shape);
                    accumulate_product(&a, &b, shape, 0, Io::InPlace([&mut want]));
                }
            }
        }
        table.put_back("w", kept);
        let mut got = vec![f32::NAN; m * n];
        table.add_kept("w", &mut got, true);
        assert!(got
            .iter()
            .zip(&want)
            .all(|(g, w)| g.to_bits() == w.to_bits()));

        let kept = Kept::default();
        // 240 floats of accumulator: a quarter is 60; a row of A and B is 32.
        assert!(kept.has_room_for(ProductShape { k: 1, m: 12, n: 20 }));
        assert!(!kept.has_room_for(ProductShape { k: 2, m: 12, n: 20 }));
        assert!(!kept.has_room_for(ProductShape {
            k: 65,
            m: 4096,
            n: 4096
        }));
        let mut kept = Kept::default();
        kept.keep(&[0.0; 40], &[0.0; 24], ProductShape { k: 1, m: 40, n: 24 });
        assert!(!kept.has_room_for(ProductShape { k: 1, m: 24, n: 40 }));
        table.forget();
    }
}
