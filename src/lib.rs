//! onnx-ga: rewrite ONNX training graphs into self-contained gradient-accumulation steps.
//!
//! The flow: [`model`] loads a `ModelProto` (with external data), [`ir`] builds a use-def
//! graph over it, [`signature`] finds the training roles (loss, seed, parameters, gradients),
//! passes rewrite the graph, and [`ir`] exports it back losslessly.

/// clap's `ValueEnum` for a library enum, from its `as_str` names, the variants in the
/// order given (the order `--help` lists them): the CLI takes the words a pipeline spec
/// does. Written out rather than derived, because the derive would turn each variant's
/// documentation into `--help` text.
macro_rules! value_enum {
    ($ty:ty: $($variant:expr),+ $(,)?) => {
        impl clap::ValueEnum for $ty {
            fn value_variants<'a>() -> &'a [Self] {
                &[$($variant),+]
            }

            fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
                Some(clap::builder::PossibleValue::new(self.as_str()))
            }
        }
    };
}

pub mod adamw;
pub mod atomic;
pub mod checkpoint;
pub mod data;
pub mod dataset;
pub mod engine;
pub mod eval_model;
pub mod evaluate;
pub mod fused_ops;
pub mod index_check;
pub mod input;
pub mod inspect;
pub mod ir;
pub mod lr_schedule;
pub mod model;
pub mod ops;
pub mod passes;
pub mod plot;
pub mod progress;
pub mod proto;
pub mod recipe;
pub mod runtime;
pub mod sample_order;
pub mod signature;
pub mod split;
pub mod state;
pub mod step;
pub mod train;
pub mod trained;
pub mod validate;
/// Data-parallel training (a mode of the trainer; see [`train::distributed`]).
pub use train::distributed;
