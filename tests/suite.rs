//! The integration tests, one binary.
//!
//! Every `tests/<concern>.rs` is a module of this crate rather than a test target of its own
//! (`autotests = false` in Cargo.toml). Each target linked the whole library with tract and
//! ort (64 MB apiece, 40 of them) and had its own incremental cache: a fresh debug build
//! filled 4.3 GB, and CI once ran out of disk linking them. One binary links once.
//!
//! Run one concern with `cargo test --test suite agc::`, one test with its full path.
//! Snapshots are `tests/snapshots/suite__<concern>__<name>.snap`.

mod common;

mod accumulation;
mod agc;
mod autodiff;
mod autodiff_keras;
mod autodiff_rules;
mod bad_inputs;
mod bias_in_gemm;
mod checker_pipelines;
mod checkpoint;
mod cli_errors;
mod cli_inspect;
mod controls;
mod data_safety;
mod device_cuda;
mod distributed;
mod draw_seed;
mod eval_loss;
mod export_trained;
mod file_cases;
mod first_hour;
mod fused_batch_norm;
mod fused_col2im;
mod fused_conv_weight_grad;
mod fused_gelu_grad;
mod fused_im2col;
mod fused_kernels;
mod fused_layer_norm_grad;
mod fused_leading_sum;
mod fused_relu_grad;
mod fused_transpose;
mod generated_files;
mod generated_flatbuffers;
mod host_scalars;
mod hostile_input;
mod ir_roundtrip;
mod legalize_ops_a;
mod legalize_ops_b;
mod legalize_training;
mod loss_scale;
mod lr_schedule;
mod model_io;
mod mutation;
mod nchwc_conv;
mod op_facts;
mod optimizer_fusion;
mod ort_runtime;
mod precision;
mod print_parses_back;
mod python_checks;
mod rewrite_snapshots;
mod sample_order;
mod split;
mod state_files;
mod streamed_data;
mod tract_engine;
mod train_cli;
mod validation;
mod verify;
mod versions;
mod zero_state;

/// A `tests/*.rs` file that is not declared above would never be compiled or run: this test
/// fails then, naming it.
#[test]
fn every_test_file_is_a_module_of_the_suite() {
    let tests = common::root().join("tests");
    let root_source = std::fs::read_to_string(tests.join("suite.rs")).unwrap();
    let mut missing = Vec::new();
    for entry in std::fs::read_dir(&tests).unwrap() {
        let path = entry.unwrap().path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.extension().is_some_and(|e| e == "rs")
            && stem != "suite"
            && !root_source.contains(&format!("\nmod {stem};\n"))
        {
            missing.push(path.display().to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "not declared in tests/suite.rs: {missing:?}"
    );
}
