//! Generates the ONNX protobuf types from `proto/onnx.proto` at build time.
//! protox compiles the schema in pure Rust, so no `protoc` binary is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/onnx.proto");
    let file_descriptors = protox::compile(["proto/onnx.proto"], ["proto"])?;
    prost_build::Config::new().compile_fds(file_descriptors)?;
    Ok(())
}
