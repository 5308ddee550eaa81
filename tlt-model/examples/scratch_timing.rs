use std::time::Instant;
fn main() -> anyhow::Result<()> {
    let path = std::env::args().nth(1).unwrap();
    let b: usize = std::env::args().nth(2).unwrap_or("1".into()).parse()?;
    let mut m = tlt_model::load_gguf(path.as_ref())?.model;
    if let Ok(d) = std::env::var("PACK") {
        m.pack_for_inference(match d.as_str() {
            "q8" => tlt_model::WeightDType::Q8_0,
            "q4" => tlt_model::WeightDType::Q4_0,
            "q41" => tlt_model::WeightDType::Q4_1,
            _ => tlt_model::WeightDType::F16,
        })?;
    }
    if std::env::var("VERIFY").is_ok() {
        let mut c = m.new_cache();
        let s = c.add_sequence();
        m.prefill(&mut c, s, &(0..128).collect::<Vec<u32>>())?;
        let par: Vec<Option<usize>> = (0..8).map(|i| if i == 0 { None } else { Some(i - 1) }).collect();
        let t0 = Instant::now();
        for _ in 0..10 {
            m.verify_tree(&mut c, s, &[1, 2, 3, 4, 5, 6, 7, 8], &par)?;
            c.commit(s, &[])?;
        }
        println!("verify8 {:.1} ms", t0.elapsed().as_secs_f64() * 100.0);
    }
    let mut cache = m.new_cache();
    let seqs: Vec<_> = (0..b).map(|_| cache.add_sequence()).collect();
    let prompt: Vec<u32> = (0..128).map(|i| (i * 37 + 11) % 49152).collect();
    let t0 = Instant::now();
    for s in &seqs {
        m.prefill(&mut cache, *s, &prompt)?;
    }
    println!("prefill {:?}", t0.elapsed());
    let t0 = Instant::now();
    let n = 16;
    for _ in 0..n {
        let batch: Vec<_> = seqs.iter().map(|s| (*s, 42u32)).collect();
        m.decode(&mut cache, &batch)?;
    }
    let dt = t0.elapsed().as_secs_f64() / n as f64;
    println!("b={b} {:.1} ms/step {:.1} tok/s", dt * 1e3, b as f64 / dt);
    Ok(())
}
