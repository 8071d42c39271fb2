//! The host calls of NCCL 2.28's device API (`nccl_device/*.h`: device communicators, barriers
//! and LL all-to-all resources for kernels that communicate themselves). oxccl has no device
//! API yet: each call that returns an `ncclResult_t` returns `ncclInvalidUsage` saying so,
//! writing nothing. (The calls that return a value instead — `ncclTeamWorld`, `ncclTeamLsa`,
//! `ncclTeamRail`, `ncclTeamRankToWorld`, `ncclTeamRankToLsa`, `ncclLLA2ACalcSlots` — are not
//! exported: they have no way to report the failure, and a missing symbol is at least loud.)
use crate::types::ncclComm_t;
use oxccl::{Error, Result};
use std::ffi::{c_int, c_void};

/// `ncclTeam_t`, passed by value: (nRanks, rank, stride).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ncclTeam_t {
    pub n_ranks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

fn unsupported(what: &str) -> Result<()> {
    Err(Error::InvalidUsage(format!(
        "{what} is part of NCCL's device API, which oxccl does not support yet"
    )))
}

nccl_api! {
    /// Not supported yet: `ncclInvalidUsage`.
    fn ncclDevCommCreate / pncclDevCommCreate(comm: ncclComm_t, reqs: *const c_void, out_dev_comm: *mut c_void) {
        let _ = (comm, reqs, out_dev_comm);
        unsupported("ncclDevCommCreate")
    }

    /// Not supported yet: `ncclInvalidUsage`.
    fn ncclDevCommDestroy / pncclDevCommDestroy(comm: ncclComm_t, dev_comm: *const c_void) {
        let _ = (comm, dev_comm);
        unsupported("ncclDevCommDestroy")
    }

    /// Not supported yet: `ncclInvalidUsage`.
    fn ncclLsaBarrierCreateRequirement / pncclLsaBarrierCreateRequirement(
        team: ncclTeam_t,
        n_barriers: c_int,
        out_handle: *mut c_void,
        out_req: *mut c_void,
    ) {
        let _ = (team, n_barriers, out_handle, out_req);
        unsupported("ncclLsaBarrierCreateRequirement")
    }

    /// Not supported yet: `ncclInvalidUsage`.
    fn ncclGinBarrierCreateRequirement / pncclGinBarrierCreateRequirement(
        comm: ncclComm_t,
        team: ncclTeam_t,
        n_barriers: c_int,
        out_handle: *mut c_void,
        out_req: *mut c_void,
    ) {
        let _ = (comm, team, n_barriers, out_handle, out_req);
        unsupported("ncclGinBarrierCreateRequirement")
    }

    /// Not supported yet: `ncclInvalidUsage`.
    fn ncclLLA2ACreateRequirement / pncclLLA2ACreateRequirement(
        n_blocks: c_int,
        n_slots: c_int,
        out_handle: *mut c_void,
        out_req: *mut c_void,
    ) {
        let _ = (n_blocks, n_slots, out_handle, out_req);
        unsupported("ncclLLA2ACreateRequirement")
    }
}
