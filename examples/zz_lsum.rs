use onnx_ga::data::Tensor;
use onnx_ga::engine::ort::{OrtSession, SessionOptions};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args[1].parse().unwrap();
    for (p, r) in [(512usize, 1024usize), (512, 768), (512, 256), (32, 18432), (8, 16384), (32, 4608)] {
        let text = format!("<ir_version: 8, opset_import: [\"\" : 17]>\ng (float[{p},{r}] x) => (float[{r}] y) {{\n  ax = Constant <value = int64[1] {{0}}> ()\n  y = ReduceSum <keepdims = 0> (x, ax)\n}}\n");
        let model = onnx_ga::ir::text::parse_model(&text).unwrap();
        let xs: Vec<Tensor> = (0..64).map(|k| Tensor::F32(ndarray::ArrayD::from_shape_fn(vec![p, r], |i| (i[0] * 7 + i[1] * 3 + k) as f32 * 1e-3))).collect();
        let mut line = format!("T{threads} [{p},{r}]");
        for fused in [false, true] {
            let o = SessionOptions { threads, fused_leading_sum: fused, ..SessionOptions::default() };
            let mut s = OrtSession::new(&model, &o).unwrap();
            assert_eq!(s.fused_leading_sums(), fused as usize);
            let mut ts = vec![];
            for i in 0..400 {
                let t = std::time::Instant::now();
                let out = s.run(&[("x", &xs[i % 64])]).unwrap();
                if i >= 50 { ts.push(t.elapsed().as_secs_f64() * 1e3); }
                std::hint::black_box(out);
            }
            ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
            line += &format!("  fused={fused}: {:.4} ms", ts[ts.len() / 10]);
        }
        println!("{line}");
    }
}
