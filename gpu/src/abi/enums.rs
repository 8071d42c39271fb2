//! The enums both sides agree on, each with one source of truth for its order: the `u8` stored in
//! [`super::WorkColl`] is the declaration index, `ALL` lists the variants in that order, and
//! `from_u8` is its inverse. NCCL keeps this order in comments across `device.h` and
//! `generate.py`; here the macro makes a mismatch impossible.

macro_rules! abi_enum {
    ($(#[$m:meta])* $name:ident { $($(#[$vm:meta])* $v:ident => $s:literal),* $(,)? }) => {
        $(#[$m])*
        #[repr(u8)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name { $($(#[$vm])* $v),* }
        impl $name {
            /// Every variant, in ABI order (`ALL[i] as u8 == i`).
            pub const ALL: &'static [$name] = &[$($name::$v),*];
            /// Number of variants.
            pub const COUNT: usize = Self::ALL.len();
            /// The name NCCL and nccl-tests print for this value.
            pub const fn name(self) -> &'static str { match self { $($name::$v => $s),* } }
            /// Inverse of `as u8`; `None` for an out-of-range value.
            pub const fn from_u8(x: u8) -> Option<Self> {
                if (x as usize) < Self::COUNT { Some(Self::ALL[x as usize]) } else { None }
            }
            /// Parses [`Self::name`] case-insensitively.
            pub fn from_name(s: &str) -> Option<Self> {
                Self::ALL.iter().copied().find(|v| v.name().eq_ignore_ascii_case(s))
            }
        }
        impl core::fmt::Display for $name {
            fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result { f.write_str(self.name()) }
        }
    };
}

abi_enum! {
    /// Element type, in `ncclDataType_t` order.
    DataType {
        I8 => "int8", U8 => "uint8", I32 => "int32", U32 => "uint32", I64 => "int64",
        U64 => "uint64", F16 => "half", F32 => "float", F64 => "double", Bf16 => "bfloat16",
        /// fp8 E4M3 (NCCL 2.24's `ncclFloat8e4m3`; [`crate::fp8::F8E4M3`]).
        F8E4M3 => "f8e4m3",
        /// fp8 E5M2 (NCCL 2.24's `ncclFloat8e5m2`; [`crate::fp8::F8E5M2`]).
        F8E5M2 => "f8e5m2",
    }
}

impl DataType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DataType::I8 | DataType::U8 | DataType::F8E4M3 | DataType::F8E5M2 => 1,
            DataType::F16 | DataType::Bf16 => 2,
            DataType::I32 | DataType::U32 | DataType::F32 => 4,
            DataType::I64 | DataType::U64 | DataType::F64 => 8,
        }
    }
    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(
            self,
            DataType::F16 | DataType::F32 | DataType::F64 | DataType::Bf16 | DataType::F8E4M3 | DataType::F8E5M2
        )
    }
    /// True for the two fp8 types, whose reductions NCCL runs only on sm_90 and newer.
    pub const fn is_fp8(self) -> bool {
        matches!(self, DataType::F8E4M3 | DataType::F8E5M2)
    }
}

abi_enum! {
    /// Reduction operator, in `ncclRedOp_t` order: the built-in operators a call names directly.
    /// PreMulSum, which needs a scalar, is `oxccl::ReduceOp::PreMulSum` on the host and
    /// [`DevRedOp::PreMulSum`] in the kernels.
    RedOp { Sum => "sum", Prod => "prod", Max => "max", Min => "min", Avg => "avg" }
}

abi_enum! {
    /// Reduction operator as the kernels see it (NCCL's `ncclDevRedOp_t`): every [`RedOp`], in
    /// the same order, then PreMulSum, whose scalar travels in `WorkColl::redop_arg`.
    DevRedOp {
        Sum => "sum", Prod => "prod", Max => "max", Min => "min", Avg => "avg",
        PreMulSum => "premulsum",
    }
}

abi_enum! {
    /// The operator of a kernel entry (the kernel entry table, gpu/build.rs): Sum (Avg too) has
    /// its own entries, with the operator compiled in; every other operator runs the `Any`
    /// entries, which read the call's operator at run time (`reduce::FuncAny`).
    KernelOp { Sum => "sum", Any => "any" }
}

impl From<DevRedOp> for KernelOp {
    fn from(op: DevRedOp) -> Self {
        match op {
            DevRedOp::Sum | DevRedOp::Avg => KernelOp::Sum,
            DevRedOp::Prod | DevRedOp::Max | DevRedOp::Min | DevRedOp::PreMulSum => KernelOp::Any,
        }
    }
}

impl From<RedOp> for DevRedOp {
    fn from(op: RedOp) -> Self {
        match op {
            RedOp::Sum => DevRedOp::Sum,
            RedOp::Prod => DevRedOp::Prod,
            RedOp::Max => DevRedOp::Max,
            RedOp::Min => DevRedOp::Min,
            RedOp::Avg => DevRedOp::Avg,
        }
    }
}

abi_enum! {
    /// Collective function, in NCCL's `ncclFunc_t` order.
    Func {
        Broadcast => "broadcast", Reduce => "reduce", AllGather => "allgather",
        ReduceScatter => "reducescatter", AllReduce => "allreduce",
    }
}

abi_enum! {
    /// Algorithm (NCCL's `NCCL_ALGO_*`).
    Algo { Tree => "tree", Ring => "ring" }
}

abi_enum! {
    /// Protocol (NCCL's `NCCL_PROTO_*`): indexes [`super::ConnInfo::buffs`].
    Proto { Ll => "LL", Ll128 => "LL128", Simple => "Simple" }
}
