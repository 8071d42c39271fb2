//! The reduction operator of a call: a built-in [`RedOp`], or PreMulSum (NCCL's
//! `ncclRedOpCreatePreMulSum`), the sum of every rank's input multiplied by that rank's scalar.
//!
//! NCCL hands out a communicator-scoped handle for PreMulSum (`ncclRedOpCreatePreMulSum` /
//! `ncclRedOpDestroy`); here the operator is a plain value that carries its scalar, so there is
//! nothing to create or destroy. The scalar is either host-immediate ([`ReduceOp::PreMulSum`],
//! NCCL's `ncclScalarHostImmediate`: its value is captured when the call is enqueued) or
//! device-resident ([`ReduceOp::PreMulSumDevice`], `ncclScalarDevice`: the kernel reads it when it
//! runs). Either way it has the call's element type, checked at every call: a scalar of another
//! width is an error, never a reinterpretation (case C07: a 2-byte bfloat16 scalar read from a
//! 4-byte float became 0).
use crate::mem::DevSlice;
use half::{bf16, f16};
use oxccl_gpu::abi::{DataType, DevRedOp, RedOp};
use oxccl_gpu::fp8::{F8E4M3, F8E5M2};

/// One value of one of the element types: a host-immediate PreMulSum scalar.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    I8(i8),
    U8(u8),
    I32(i32),
    U32(u32),
    I64(i64),
    U64(u64),
    F16(f16),
    F32(f32),
    F64(f64),
    Bf16(bf16),
    F8E4M3(F8E4M3),
    F8E5M2(F8E5M2),
}

impl Scalar {
    /// The element type of the value.
    pub fn dtype(&self) -> DataType {
        match self {
            Scalar::I8(_) => DataType::I8,
            Scalar::U8(_) => DataType::U8,
            Scalar::I32(_) => DataType::I32,
            Scalar::U32(_) => DataType::U32,
            Scalar::I64(_) => DataType::I64,
            Scalar::U64(_) => DataType::U64,
            Scalar::F16(_) => DataType::F16,
            Scalar::F32(_) => DataType::F32,
            Scalar::F64(_) => DataType::F64,
            Scalar::Bf16(_) => DataType::Bf16,
            Scalar::F8E4M3(_) => DataType::F8E4M3,
            Scalar::F8E5M2(_) => DataType::F8E5M2,
        }
    }

    /// The value's bits in the low `dtype().size()` bytes (the kernel's `WorkColl::redop_arg`).
    pub fn to_bits(&self) -> u64 {
        match *self {
            Scalar::I8(v) => v as u8 as u64,
            Scalar::U8(v) => v as u64,
            Scalar::I32(v) => v as u32 as u64,
            Scalar::U32(v) => v as u64,
            Scalar::I64(v) => v as u64,
            Scalar::U64(v) => v,
            Scalar::F16(v) => v.to_bits() as u64,
            Scalar::F32(v) => v.to_bits() as u64,
            Scalar::F64(v) => v.to_bits(),
            Scalar::Bf16(v) => v.to_bits() as u64,
            Scalar::F8E4M3(v) => v.0 as u64,
            Scalar::F8E5M2(v) => v.0 as u64,
        }
    }

    /// `x` converted to `dtype` (rounded to nearest for the float types, truncated toward zero
    /// and saturated for the integer types): e.g. `1 / nranks` as a scalar of the call's type.
    pub fn from_f64(x: f64, dtype: DataType) -> Scalar {
        match dtype {
            DataType::I8 => Scalar::I8(x as i8),
            DataType::U8 => Scalar::U8(x as u8),
            DataType::I32 => Scalar::I32(x as i32),
            DataType::U32 => Scalar::U32(x as u32),
            DataType::I64 => Scalar::I64(x as i64),
            DataType::U64 => Scalar::U64(x as u64),
            DataType::F16 => Scalar::F16(f16::from_f64(x)),
            DataType::F32 => Scalar::F32(x as f32),
            DataType::F64 => Scalar::F64(x),
            DataType::Bf16 => Scalar::Bf16(bf16::from_f64(x)),
            DataType::F8E4M3 => Scalar::F8E4M3(F8E4M3::from_f64(x)),
            DataType::F8E5M2 => Scalar::F8E5M2(F8E5M2::from_f64(x)),
        }
    }
}

macro_rules! scalar_from {
    ($($t:ty => $v:ident),*) => {$(
        impl From<$t> for Scalar {
            fn from(x: $t) -> Scalar {
                Scalar::$v(x)
            }
        }
    )*};
}
scalar_from!(i8 => I8, u8 => U8, i32 => I32, u32 => U32, i64 => I64, u64 => U64, f16 => F16,
    f32 => F32, f64 => F64, bf16 => Bf16, F8E4M3 => F8E4M3, F8E5M2 => F8E5M2);

/// The reduction operator of a call. Every built-in [`RedOp`] converts into it, so
/// `comm.all_reduce(.., RedOp::Sum, ..)` reads as before.
#[derive(Clone, Copy, Debug)]
pub enum ReduceOp<'a> {
    /// A built-in operator.
    Builtin(RedOp),
    /// PreMulSum with a host-immediate scalar (NCCL's `ncclScalarHostImmediate`): each rank's
    /// input times this rank's scalar, summed. The scalar's type must be the call's `dtype`.
    PreMulSum(Scalar),
    /// PreMulSum with a device-resident scalar (NCCL's `ncclScalarDevice`): the first element of
    /// the slice, of the call's `dtype`, read by the kernel when it runs (so it may be written by
    /// earlier work on the same stream). The slice is on this rank's device, holds at least one
    /// element and is aligned to the element size.
    PreMulSumDevice(DevSlice<'a>),
}

impl From<RedOp> for ReduceOp<'_> {
    fn from(op: RedOp) -> Self {
        ReduceOp::Builtin(op)
    }
}

impl ReduceOp<'_> {
    /// PreMulSum with a host-immediate scalar: `ReduceOp::pre_mul_sum(0.5f32)`.
    pub fn pre_mul_sum(scalar: impl Into<Scalar>) -> Self {
        ReduceOp::PreMulSum(scalar.into())
    }

    /// The operator the kernels run ([`DevRedOp`]).
    pub fn dev_op(&self) -> DevRedOp {
        match self {
            ReduceOp::Builtin(op) => (*op).into(),
            ReduceOp::PreMulSum(_) | ReduceOp::PreMulSumDevice(_) => DevRedOp::PreMulSum,
        }
    }
}

impl std::fmt::Display for ReduceOp<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReduceOp::Builtin(op) => write!(f, "{op}"),
            ReduceOp::PreMulSum(s) => write!(f, "premulsum({s:?})"),
            ReduceOp::PreMulSumDevice(s) => write!(f, "premulsum(device {:#x})", s.addr()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_bits_are_the_values_own_width() {
        assert_eq!(Scalar::from(bf16::from_f32(0.5)).to_bits(), 0x3f00);
        assert_eq!(Scalar::from(f16::from_f32(2.0)).to_bits(), 0x4000);
        assert_eq!(Scalar::from(0.5f32).to_bits(), 0x3f00_0000);
        assert_eq!(Scalar::from(4.0f64).to_bits(), 0x4010_0000_0000_0000);
        assert_eq!(Scalar::from(-1i8).to_bits(), 0xff);
        assert_eq!(Scalar::from(-1i32).to_bits(), 0xffff_ffff);
        assert_eq!(
            Scalar::from_f64(0.25, DataType::Bf16),
            Scalar::Bf16(bf16::from_f32(0.25))
        );
        assert_eq!(Scalar::from_f64(3.9, DataType::I32), Scalar::I32(3));
        assert_eq!(Scalar::from_f64(0.5, DataType::F8E4M3).to_bits(), 0x30);
        assert_eq!(Scalar::from_f64(0.5, DataType::F8E5M2).to_bits(), 0x38);
        for &d in DataType::ALL {
            assert_eq!(Scalar::from_f64(1.0, d).dtype(), d);
        }
    }

    #[test]
    fn builtin_ops_keep_their_kernel_operator() {
        for (i, &op) in RedOp::ALL.iter().enumerate() {
            assert_eq!(ReduceOp::from(op).dev_op() as usize, i);
        }
        assert_eq!(ReduceOp::pre_mul_sum(1u8).dev_op(), DevRedOp::PreMulSum);
    }
}
