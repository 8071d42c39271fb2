//! PreMulSum operators (NCCL's `ncclRedOpCreatePreMulSum`/`ncclRedOpDestroy`). oxccl's
//! PreMulSum is a value carrying its scalar (`oxccl::ReduceOp::PreMulSum`), so an operator
//! handle is an index into its communicator's table ([`crate::handles::Live::redops`]):
//! operator `ncclNumOps + i` is entry `i`, used only with that communicator and its data type.
//! Host-immediate scalars are read when the operator is created, as NCCL does; device-resident
//! ones (`oxccl::ReduceOp::PreMulSumDevice`) are read by each call's kernel when it runs.
use crate::errors::non_null;
use crate::handles::{self, PreMul, PreMulScalar};
use crate::types::*;
use half::{bf16, f16};
use oxccl::{DataType, Error, Scalar};
use std::ffi::c_void;

/// The value of type `dtype` at `p`.
///
/// # Safety
/// `p` points to one readable element of `dtype` (any alignment).
unsafe fn read_scalar(p: *const c_void, dtype: DataType) -> Scalar {
    // SAFETY (every arm): the caller's contract, for the arm's element type.
    unsafe {
        match dtype {
            DataType::I8 => Scalar::I8(p.cast::<i8>().read_unaligned()),
            DataType::U8 => Scalar::U8(p.cast::<u8>().read_unaligned()),
            DataType::I32 => Scalar::I32(p.cast::<i32>().read_unaligned()),
            DataType::U32 => Scalar::U32(p.cast::<u32>().read_unaligned()),
            DataType::I64 => Scalar::I64(p.cast::<i64>().read_unaligned()),
            DataType::U64 => Scalar::U64(p.cast::<u64>().read_unaligned()),
            DataType::F16 => Scalar::F16(f16::from_bits(p.cast::<u16>().read_unaligned())),
            DataType::F32 => Scalar::F32(p.cast::<f32>().read_unaligned()),
            DataType::F64 => Scalar::F64(p.cast::<f64>().read_unaligned()),
            DataType::Bf16 => Scalar::Bf16(bf16::from_bits(p.cast::<u16>().read_unaligned())),
            DataType::F8E4M3 => Scalar::F8E4M3(oxccl::F8E4M3(p.cast::<u8>().read())),
            DataType::F8E5M2 => Scalar::F8E5M2(oxccl::F8E5M2(p.cast::<u8>().read())),
        }
    }
}

nccl_api! {
    /// A PreMulSum operator of `comm` for `datatype`: each rank's input times its `*scalar`,
    /// summed. With `ncclScalarHostImmediate` the scalar is read now; with `ncclScalarDevice`
    /// `scalar` is one element on the rank's device, read by each call's kernel when it runs (so
    /// earlier work on the call's stream may write it), and must stay allocated while the
    /// operator is used.
    fn ncclRedOpCreatePreMulSum / pncclRedOpCreatePreMulSum(
        op: *mut ncclRedOp_t,
        scalar: *mut c_void,
        datatype: ncclDataType_t,
        residence: ncclScalarResidence_t,
        comm: ncclComm_t,
    ) {
        non_null("op", op)?;
        non_null("scalar", scalar)?;
        let live = handles::get(comm)?;
        let dtype = data_type(datatype)?;
        let scalar = match residence {
            // SAFETY: non-NULL; NCCL's contract: one element of `datatype` in host memory.
            ncclScalarHostImmediate => PreMulScalar::Host(unsafe { read_scalar(scalar, dtype) }),
            // The calls check its alignment (`Comm::collective_raw`); that it is memory of the
            // rank's device is NCCL's contract with the caller, as for the buffers.
            ncclScalarDevice => PreMulScalar::Device(scalar as u64),
            r => {
                return Err(Error::InvalidArgument(format!(
                    "residence {r} is not an ncclScalarResidence_t (accepted: 0 ncclScalarDevice, 1 ncclScalarHostImmediate)"
                )));
            }
        };
        let mut ops = live.redops();
        let entry = PreMul { dtype, scalar };
        let i = match ops.iter().position(|o| o.is_none()) {
            Some(i) => {
                ops[i] = Some(entry);
                i
            }
            None => {
                ops.push(Some(entry));
                ops.len() - 1
            }
        };
        let value = i32::try_from(i).ok().and_then(|i| i.checked_add(ncclNumOps)).filter(|v| *v <= ncclMaxRedOp);
        let Some(value) = value else {
            ops[i] = None;
            return Err(Error::InvalidUsage("too many PreMulSum operators on this communicator".into()));
        };
        // SAFETY: non-NULL; NCCL's contract: a writable ncclRedOp_t.
        unsafe { op.write(value) };
        Ok(())
    }

    /// Destroys PreMulSum operator `op` of `comm` (`ncclInvalidArgument` for a built-in operator
    /// or one this communicator does not hold).
    fn ncclRedOpDestroy / pncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) {
        let live = handles::get(comm)?;
        if builtin_op(op).is_some() {
            return Err(Error::InvalidArgument(format!(
                "op {op} is a built-in operator; only PreMulSum operators are destroyed"
            )));
        }
        let mut ops = live.redops();
        let slot = premul_index(op).and_then(|i| ops.get_mut(i));
        match slot {
            Some(s @ Some(_)) => {
                *s = None;
                Ok(())
            }
            _ => Err(Error::InvalidArgument(format!(
                "op {op} is not a PreMulSum operator of this communicator (never created here, or already destroyed)"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_are_read_at_their_own_width() {
        let h = f16::from_f32(0.5).to_bits();
        // SAFETY: locals of the read types.
        unsafe {
            assert_eq!(read_scalar((&raw const h).cast(), DataType::F16), Scalar::F16(f16::from_f32(0.5)));
            let x = 3.25f64;
            assert_eq!(read_scalar((&raw const x).cast(), DataType::F64), Scalar::F64(3.25));
            let b = [0u8, 0x80, 0x3f, 0xff];
            assert_eq!(read_scalar(b.as_ptr().add(1).cast(), DataType::Bf16), Scalar::Bf16(bf16::from_bits(0x3f80)));
        }
    }
}
