//! Half and bfloat16 reductions give the bits of "compute in f32, round once", on every protocol.
//! On the GPU the kernels reduce whole packs of halves with the packed `add.rn.f16x2` /
//! `mul.rn.f16x2` (NCCL's `__hadd2` / `__hmul2`) and convert with the hardware `cvt`; bfloat16
//! packs are widened by shifts and rounded with integer adds; the element-wise tail and the CPU
//! target use the `half` crate's conversions. All must agree with the f32 reference for every
//! finite result (f32 has 24 ≥ 2p+2 bits for p = 11 and 8, so rounding twice is innocuous for +
//! and ×), and give a NaN wherever the reference does.
//!
//! Data: a 2-rank AllReduce whose rank 0 holds every one of the 65 536 bit patterns three
//! times and rank 1 a different permutation of them each time (`i · m + 7 mod 2^16`, odd `m`), so
//! the pairs cover normals, subnormals, zeros of both signs, infinities, NaNs, overflow and
//! cancellation; 5 extra elements make the count no whole number of 16-byte packs, so the
//! element-wise tail runs too. Sum, prod, min, max and avg (sum, then a division by 2 in f32),
//! forced LL, LL128 and Simple, out of place, on both ranks. min/max may see their operands in
//! either order (a ring's order), which only matters for ±0 and NaN; both orders are accepted.
//!
//! GPU: 2 GPUs, or GPU 0 shared by 2 ranks; without a GPU that test prints `SKIPPED: …`. The CPU
//! target always runs.
use crate::common;

use half::{bf16, f16};
use oxccl::{Comm, DataType, Device, RedOp};

/// One 16-bit float type: its conversions (the reference's) and its special cases.
#[derive(Clone, Copy)]
struct Ty {
    dtype: DataType,
    f: fn(u16) -> f32,
    round: fn(f32) -> u16,
    exp_mask: u16,
    /// The tail pairs (rank 0, rank 1): a sum that overflows, one that cancels, a subnormal pair,
    /// 1 + ulp/2 (a tie that rounds to even) and a quiet NaN plus one.
    tail: [[u16; 2]; TAIL],
    /// Their expected sums (the NaN's is checked as "a NaN").
    tail_sums: [u16; TAIL - 1],
}

const F16: Ty = Ty {
    dtype: DataType::F16,
    f: |b| f16::from_bits(b).to_f32(),
    round: |x| f16::from_f32(x).to_bits(),
    exp_mask: 0x7c00,
    tail: [
        [0x7bff, 0x7bff],
        [0x3c00, 0xbc00],
        [0x0001, 0x0003],
        [0x3c00, 0x1000],
        [0x7e00, 0x3c00],
    ],
    tail_sums: [0x7c00, 0x0000, 0x0004, 0x3c00],
};

const BF16: Ty = Ty {
    dtype: DataType::Bf16,
    f: |b| bf16::from_bits(b).to_f32(),
    round: |x| bf16::from_f32(x).to_bits(),
    exp_mask: 0x7f80,
    tail: [
        [0x7f7f, 0x7f7f],
        [0x3f80, 0xbf80],
        [0x0001, 0x0003],
        [0x3f80, 0x3b80],
        [0x7fc0, 0x3f80],
    ],
    tail_sums: [0x7f80, 0x0000, 0x0004, 0x3f80],
};

/// Rank 1's permutations of the 2^16 patterns.
const MULTS: [u32; 3] = [1, 40503, 9973];
const TAIL: usize = 5;
const COUNT: usize = MULTS.len() * 65536 + TAIL;
const OPS: [RedOp; 5] = [RedOp::Sum, RedOp::Prod, RedOp::Min, RedOp::Max, RedOp::Avg];

/// Rank `r`'s input bits.
fn input(t: &Ty, r: usize) -> Vec<u16> {
    let mut v = Vec::with_capacity(COUNT);
    for &m in &MULTS {
        for i in 0..65536u32 {
            v.push(if r == 0 {
                i
            } else {
                i.wrapping_mul(m).wrapping_add(7)
            } as u16);
        }
    }
    v.extend(t.tail.iter().map(|p| p[r]));
    v
}

/// The f32 reference of `op(a, b)`, as the kernels order the operands (`b` compared first).
fn reference(t: &Ty, op: RedOp, a: u16, b: u16) -> u16 {
    let (f, round) = (t.f, t.round);
    match op {
        RedOp::Sum => round(f(a) + f(b)),
        RedOp::Prod => round(f(a) * f(b)),
        RedOp::Min => {
            if f(b) < f(a) {
                b
            } else {
                a
            }
        }
        RedOp::Max => {
            if f(b) > f(a) {
                b
            } else {
                a
            }
        }
        RedOp::Avg => round(f(round(f(a) + f(b))) / 2.0),
    }
}

fn is_nan(t: &Ty, b: u16) -> bool {
    b & t.exp_mask == t.exp_mask && b & !t.exp_mask & 0x7fff != 0
}

/// Whether `got` is the reference of `op` over `a`, `b` in either order (NaN: any NaN).
fn matches(t: &Ty, op: RedOp, a: u16, b: u16, got: u16) -> bool {
    [reference(t, op, a, b), reference(t, op, b, a)]
        .iter()
        .any(|&want| {
            if is_nan(t, want) {
                is_nan(t, got)
            } else {
                got == want
            }
        })
}

/// Runs the matrix on `devices` (2 ranks); returns the mismatches found, described.
fn run(devices: &[Device]) -> Vec<String> {
    let mut bad = Vec::new();
    for t in [F16, BF16] {
        run_type(devices, &t, &mut bad);
    }
    bad
}

fn run_type(devices: &[Device], t: &Ty, bad: &mut Vec<String>) {
    let inputs: Vec<Vec<u16>> = (0..2).map(|r| input(t, r)).collect();
    let name = t.dtype.name();
    for proto in ["LL", "LL128", "Simple"] {
        let comms: Vec<Comm> = common::init_comms(devices, Some(proto));
        let streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
        let sends: Vec<_> = comms
            .iter()
            .zip(&inputs)
            .map(|(c, v)| {
                let b = c.device().alloc(COUNT * 2).unwrap();
                b.write(0, bytemuck::cast_slice(v)).unwrap();
                b
            })
            .collect();
        let recvs: Vec<_> = comms
            .iter()
            .map(|c| c.device().alloc(COUNT * 2).unwrap())
            .collect();
        for op in OPS {
            for r in &recvs {
                r.write(0, &vec![0xA5; COUNT * 2]).unwrap(); // poison: 0xA5A5 is finite in both
            }
            for (r, c) in comms.iter().enumerate() {
                c.all_reduce(&sends[r], &recvs[r], COUNT, t.dtype, op, &streams[r])
                    .unwrap_or_else(|e| panic!("{name} {proto} {op:?} rank {r}: {e}"));
            }
            for s in &streams {
                s.synchronize().unwrap();
            }
            for (r, out) in recvs.iter().enumerate() {
                let got = out.to_vec().unwrap();
                let mut wrong = 0usize;
                for i in 0..COUNT {
                    let g = u16::from_ne_bytes([got[2 * i], got[2 * i + 1]]);
                    let (a, b) = (inputs[0][i], inputs[1][i]);
                    if !matches(t, op, a, b, g) {
                        if wrong < 4 {
                            bad.push(format!(
                                "{name} {proto} {op:?} rank {r} element {i}: {a:#06x} op {b:#06x} \
                                 gave {g:#06x}, want {:#06x}",
                                reference(t, op, a, b)
                            ));
                        }
                        wrong += 1;
                    }
                }
                if wrong > 0 {
                    bad.push(format!(
                        "{name} {proto} {op:?} rank {r}: #wrong {wrong} of {COUNT}"
                    ));
                }
            }
        }
    }
}

#[test]
fn reference_sees_the_cases_it_is_meant_to() {
    for t in [F16, BF16] {
        let name = t.dtype.name();
        let (a, b) = (input(&t, 0), input(&t, 1));
        let k = a.len() - TAIL;
        for (j, &want) in t.tail_sums.iter().enumerate() {
            assert_eq!(
                reference(&t, RedOp::Sum, a[k + j], b[k + j]),
                want,
                "{name} tail {j}"
            );
        }
        assert!(
            is_nan(&t, reference(&t, RedOp::Sum, a[k + 4], b[k + 4])),
            "{name}"
        );
        assert!(
            !is_nan(&t, t.tail_sums[0]) && !is_nan(&t, 0xA5A5),
            "{name}: inf, poison"
        );
        let (one, two) = ((t.round)(1.0), (t.round)(2.0));
        assert_eq!(
            (t.f)(reference(&t, RedOp::Avg, one, two)),
            1.5,
            "{name} avg(1, 2)"
        );
        // The permutations are permutations.
        for m in 0..MULTS.len() {
            let mut seen = vec![false; 65536];
            for &x in &b[m * 65536..(m + 1) * 65536] {
                seen[x as usize] = true;
            }
            assert!(seen.iter().all(|&s| s), "permutation {m}");
        }
    }
}

#[test]
fn half_reductions_match_f32_reference_cpu() {
    let bad = run(&Device::cpus(2));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn half_reductions_match_f32_reference_gpu() {
    let test = "half_reductions_match_f32_reference_gpu";
    let _gpu = common::gpu_lock();
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    let bad = run(&devices);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
