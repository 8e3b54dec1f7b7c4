//! Prints a model in ONNX textual syntax and runs the verifier on it.
//! `cargo run --example print_graph -- graphs/mlp_ce_adamw/training_model.onnx`

fn main() -> anyhow::Result<()> {
    let path = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: print_graph MODEL.onnx"))?;
    let proto = onnx_ga::model::load_model(std::path::Path::new(&path))?;
    let model = onnx_ga::ir::Model::from_proto(proto);
    print!("{}", onnx_ga::ir::print::print_model(&model));
    match onnx_ga::ir::verify::verify(&model) {
        Ok(()) => println!("# verify: ok"),
        Err(e) => println!("# {e}"),
    }
    Ok(())
}
