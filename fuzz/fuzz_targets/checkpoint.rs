//! The ONNX Runtime checkpoint reader on arbitrary bytes: an error or a checkpoint, never
//! a panic, a hang or an allocation the bytes do not justify.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let origin = std::path::Path::new("/nonexistent/fuzz/checkpoint");
    if let Ok(ckpt) = onnx_ga::checkpoint::parse_checkpoint(data, origin) {
        for t in ckpt.trainable.iter().chain(&ckpt.frozen) {
            let _ = t.as_f32();
        }
    }
});
