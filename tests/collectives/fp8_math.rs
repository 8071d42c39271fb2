//! fp8 reductions (E4M3 and E5M2) give NCCL's bits for every pair of operands, on every protocol:
//! NCCL widens both operands to binary16, applies `__hadd` / `__hmul` / `__hmin` / `__hmax`, and
//! narrows with `__nv_fp8_*(__half)`: nearest even, satfinite (±largest finite for overflow and
//! infinity), NaN → `0x7f`; Avg is PreMulSum by 1/nranks (here ½, exact). The reference below
//! rounds by searching the type's 256 values for the nearest one, independently of oxccl's
//! conversions. Min and max keep the first operand when either is a NaN (oxccl's convention for
//! every float type; a ring may present the operands in either order, so both are accepted).
//!
//! Data: a 2-rank AllReduce over 65,536 + 5 elements: rank 0 holds `i & 0xff`, rank 1 `i >> 8`, so
//! every (a, b) pair of bit patterns meets once; the 5 extra elements make the count no whole
//! number of packs, so the element-wise tail runs too. Forced LL, LL128 and Simple, out of place,
//! both ranks checked. CPU target always; on GPUs when present (otherwise the test prints why it
//! skipped).
use crate::common;

use oxccl::{Comm, DataType, Device, RedOp};

const COUNT: usize = 65536 + 5;

/// One fp8 type: its bit width layout for the reference.
#[derive(Clone, Copy)]
struct Ty {
    dtype: DataType,
    ebits: i32,
    mbits: i32,
    /// Whether the all-ones exponent holds infinities and NaNs (E5M2) rather than numbers (E4M3,
    /// whose only NaN is `S.1111.111`).
    ieee: bool,
}

const E4M3: Ty = Ty { dtype: DataType::F8E4M3, ebits: 4, mbits: 3, ieee: false };
const E5M2: Ty = Ty { dtype: DataType::F8E5M2, ebits: 5, mbits: 2, ieee: true };

/// The value of bits `b` (NaN for a NaN, ±inf for E5M2's infinities), from the layout alone.
fn value(t: &Ty, b: u8) -> f64 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b & 0x7f) >> t.mbits) as i32;
    let m = (b & ((1 << t.mbits) - 1)) as i32;
    let emax = (1 << t.ebits) - 1;
    let bias = (1 << (t.ebits - 1)) - 1;
    if t.ieee && e == emax {
        return if m == 0 { sign * f64::INFINITY } else { f64::NAN };
    }
    if !t.ieee && e == emax && m == (1 << t.mbits) - 1 {
        return f64::NAN;
    }
    let frac = m as f64 / (1 << t.mbits) as f64;
    if e == 0 {
        sign * frac * 2f64.powi(1 - bias)
    } else {
        sign * (1.0 + frac) * 2f64.powi(e - bias)
    }
}

/// The bits nearest to `v` (ties to the even code), satfinite, NaN → 0x7f: a search over the
/// type's finite values.
fn nearest(t: &Ty, v: f64) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80 } else { 0 };
    let max = (0..0x80u8).filter(|&b| value(t, b).is_finite()).max_by(|&a, &b| value(t, a).total_cmp(&value(t, b)));
    let max = max.expect("a finite value");
    if v.abs() >= value(t, max) {
        return sign | max; // satfinite: beyond the largest finite value, infinity included
    }
    let mut best: Option<(f64, u8)> = None;
    for b in 0..=255u8 {
        let x = value(t, b);
        if !x.is_finite() || (x == 0.0 && (b & 0x80 != 0) != v.is_sign_negative()) {
            continue;
        }
        let d = (x - v).abs();
        best = match best {
            None => Some((d, b)),
            Some((bd, bb)) if d < bd || (d == bd && b & 1 == 0 && bb & 1 == 1) => Some((d, b)),
            keep => keep,
        };
    }
    best.map_or(0x7f, |(_, b)| b)
}

/// `x` rounded to binary16 (NCCL's arithmetic precision), then to the type ([`nearest`] of
/// every binary16 value, computed once per type).
fn via_half(t: &Ty, x: f64) -> u8 {
    static TABLES: std::sync::OnceLock<[Vec<u8>; 2]> = std::sync::OnceLock::new();
    let tables = TABLES.get_or_init(|| {
        [E4M3, E5M2].map(|t| (0..=u16::MAX).map(|h| nearest(&t, half::f16::from_bits(h).to_f64())).collect())
    });
    tables[usize::from(t.ieee)][half::f16::from_f64(x).to_bits() as usize]
}

/// NCCL's result of `op(a, b)` with `a` first.
fn reference(t: &Ty, op: RedOp, a: u8, b: u8) -> u8 {
    let (x, y) = (value(t, a), value(t, b));
    match op {
        RedOp::Sum => via_half(t, x + y),
        RedOp::Prod => via_half(t, x * y),
        RedOp::Avg => {
            let (hx, hy) = (value(t, via_half(t, x * 0.5)), value(t, via_half(t, y * 0.5)));
            via_half(t, hx + hy)
        }
        RedOp::Min | RedOp::Max => {
            let take_b = !x.is_nan() && !y.is_nan() && if op == RedOp::Min { y < x } else { y > x };
            via_half(t, if take_b { y } else { x })
        }
    }
}

fn matches(t: &Ty, op: RedOp, a: u8, b: u8, got: u8) -> bool {
    got == reference(t, op, a, b) || (matches!(op, RedOp::Min | RedOp::Max) && got == reference(t, op, b, a))
}

fn input(r: usize) -> Vec<u8> {
    (0..COUNT).map(|i| if r == 0 { (i & 0xff) as u8 } else { ((i >> 8) & 0xff) as u8 }).collect()
}

/// Runs every type × protocol × operator on `devices` (2 ranks); the mismatches, described.
fn run(devices: &[Device]) -> Vec<String> {
    let mut bad = Vec::new();
    let inputs: Vec<Vec<u8>> = (0..2).map(input).collect();
    for t in [E4M3, E5M2] {
        let name = t.dtype.name();
        for proto in ["LL", "LL128", "Simple"] {
            let comms: Vec<Comm> = common::init_comms(devices, Some(proto));
            let streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
            let sends: Vec<_> = comms
                .iter()
                .zip(&inputs)
                .map(|(c, v)| {
                    let b = c.device().alloc(COUNT).unwrap();
                    b.write(0, v).unwrap();
                    b
                })
                .collect();
            let recvs: Vec<_> = comms.iter().map(|c| c.device().alloc(COUNT).unwrap()).collect();
            for op in RedOp::ALL.iter().copied() {
                for r in &recvs {
                    r.write(0, &vec![0xA5; COUNT]).unwrap();
                }
                for (r, c) in comms.iter().enumerate() {
                    c.all_reduce(&sends[r], &recvs[r], COUNT, t.dtype, op, &streams[r])
                        .unwrap_or_else(|e| panic!("{name} {proto} {op:?} rank {r}: {e}"));
                }
                common::sync_all(&streams, &format!("{name} {proto} {op:?}"));
                for (r, out) in recvs.iter().enumerate() {
                    let got = out.to_vec().unwrap();
                    let mut wrong = 0usize;
                    for i in 0..COUNT {
                        let (a, b) = (inputs[0][i], inputs[1][i]);
                        if !matches(&t, op, a, b, got[i]) {
                            if wrong < 4 {
                                bad.push(format!(
                                    "{name} {proto} {op:?} rank {r} element {i}: {a:#04x} op {b:#04x} gave {:#04x}, want {:#04x}",
                                    got[i],
                                    reference(&t, op, a, b)
                                ));
                            }
                            wrong += 1;
                        }
                    }
                    if wrong > 0 {
                        bad.push(format!("{name} {proto} {op:?} rank {r}: #wrong {wrong} of {COUNT}"));
                    }
                }
            }
        }
    }
    bad
}

/// The reference knows the formats' landmarks: largest finite values, NaN, infinity, ties.
#[test]
fn reference_sees_the_cases_it_is_meant_to() {
    assert_eq!(value(&E4M3, 0x7e), 448.0);
    assert!(value(&E4M3, 0x7f).is_nan() && value(&E4M3, 0xff).is_nan());
    assert_eq!(value(&E4M3, 0x01), 2f64.powi(-9));
    assert_eq!(value(&E5M2, 0x7b), 57344.0);
    assert_eq!(value(&E5M2, 0x7c), f64::INFINITY);
    assert_eq!(value(&E5M2, 0x01), 2f64.powi(-16));
    assert_eq!(reference(&E4M3, RedOp::Sum, 0x7e, 0x7e), 0x7e, "448 + 448 saturates");
    assert_eq!(reference(&E5M2, RedOp::Max, 0x7c, 0x3c), 0x7b, "max(inf, 1): infinity saturates");
    assert_eq!(reference(&E4M3, RedOp::Sum, 0x7f, 0x38), 0x7f, "NaN + 1");
    // 16 + 1 = 17 lies between 16 (0x58) and 18 (0x59): the even code.
    assert_eq!(reference(&E4M3, RedOp::Sum, 0x58, 0x38), 0x58);
    assert_eq!(reference(&E4M3, RedOp::Avg, 0x38, 0x40), nearest(&E4M3, 1.5), "avg(1, 2)");
    // Every pair meets once.
    let (a, b) = (input(0), input(1));
    let mut seen = vec![false; 65536];
    for i in 0..65536 {
        seen[a[i] as usize | (b[i] as usize) << 8] = true;
    }
    assert!(seen.iter().all(|&s| s));
}

#[test]
fn fp8_reductions_match_nccl_for_every_pair_cpu() {
    let bad = run(&Device::cpus(2));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn fp8_reductions_match_nccl_for_every_pair_gpu() {
    let test = "fp8_reductions_match_nccl_for_every_pair_gpu";
    let _gpu = common::gpu_lock();
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    let bad = run(&devices);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
