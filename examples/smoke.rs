use oxccl::*;
fn main() -> Result<()> {
    let cuda = Device::cuda_count();
    let ranks: Vec<usize> = if cuda > 0 { vec![cuda] } else { vec![2, 3, 4] };
    for nranks in ranks {
        for count in [0usize, 1, 3, 1023, 1025, (1 << 20) + 3, 1 << 26] {
            let devs = if cuda > 0 { Device::all_cuda() } else { Device::cpus(nranks) };
            let comms = Comm::init_all(&devs)?;
            if cuda > 0 { let m = oxccl::cuda::Context::get(0)?; let m = m.module()?; println!("regs {} local {} maxthreads {} load {:.3}s", m.num_regs, m.local_bytes, m.max_threads, m.load_seconds); }
            let mut bufs = vec![];
            let mut streams = vec![];
            for (r, c) in comms.iter().enumerate() {
                let s = c.device().alloc(count * 4)?;
                let rb = c.device().alloc(count * 4)?;
                let v: Vec<u8> = (0..count).flat_map(|i| ((r + i) as u32).to_ne_bytes()).collect();
                s.write(0, &v)?;
                bufs.push((s, rb));
                streams.push(c.device().new_stream()?);
            }
            let t = std::time::Instant::now();
            for (r, c) in comms.iter().enumerate() {
                c.all_reduce(&bufs[r].0, &bufs[r].1, count, DataType::U32, RedOp::Sum, &streams[r])?;
            }
            for s in &streams { s.synchronize()?; }
            let el = t.elapsed();
            let iters = 20;
            let t2 = std::time::Instant::now();
            for _ in 0..iters {
                for (r, c) in comms.iter().enumerate() {
                    c.all_reduce(&bufs[r].0, &bufs[r].1, count, DataType::U32, RedOp::Sum, &streams[r])?;
                }
            }
            for s in &streams { s.synchronize()?; }
            let per = t2.elapsed().as_secs_f64() / iters as f64;
            println!("  time/iter {:.1} us busbw {:.1} GB/s", per * 1e6, (count * 4) as f64 / per / 1e9 * 2.0 * (nranks - 1) as f64 / nranks as f64);
            let mut wrong = 0;
            for r in 0..nranks {
                let out = bufs[r].1.to_vec()?;
                for i in 0..count {
                    let got = u32::from_ne_bytes(out[i*4..i*4+4].try_into().unwrap());
                    let exp: u32 = (0..nranks).map(|k| (k + i) as u32).sum();
                    if got != exp { wrong += 1; }
                }
            }
            println!("nranks {nranks} count {count}: wrong {wrong} in {el:?} choice {:?}", comms[0].last_choice());
        }
    }
    Ok(())
}
