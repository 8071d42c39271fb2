//! Communicators from a launcher's environment ([`Comm::from_env`]): the variables torchrun,
//! Slurm wrappers and `mpirun` scripts set for each process (`RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `MASTER_ADDR`/`MASTER_PORT` or NCCL's `NCCL_COMM_ID`), turned into one
//! [`Comm::init_rank`]. NCCL itself leaves this to its callers (PyTorch's `init_process_group`).
use super::*;

impl Comm {
    /// One rank per process from a launcher's environment, as torchrun and Slurm wrappers set it:
    /// `RANK`, `WORLD_SIZE`, `LOCAL_RANK` (default: `RANK`), and the rendezvous address from
    /// `NCCL_COMM_ID` / `OXCCL_COMM_ID` (`host:port`) or else `MASTER_ADDR` and `MASTER_PORT`;
    /// rank 0 runs the bootstrap root there. The device is GPU `LOCAL_RANK` when GPUs are visible,
    /// else CPU-target device `LOCAL_RANK`. Then as [`Comm::init_rank`]. Errors name the missing or
    /// malformed variable.
    pub fn from_env() -> Result<Comm> {
        let var = |k: &str| {
            std::env::var(k).map_err(|_| Error::invalid(format!("{k} is not set (needed by Comm::from_env)")))
        };
        let num = |k: &str, v: String| {
            v.trim()
                .parse::<usize>()
                .map_err(|_| Error::invalid(format!("{k}={v:?} is not a non-negative integer")))
        };
        let rank = num("RANK", var("RANK")?)?;
        let world = num("WORLD_SIZE", var("WORLD_SIZE")?)?;
        let local = match std::env::var("LOCAL_RANK") {
            Ok(v) => num("LOCAL_RANK", v)?,
            Err(_) => rank,
        };
        if world == 0 || rank >= world {
            return Err(Error::invalid(format!(
                "RANK={rank} is out of range for WORLD_SIZE={world} (accepted: 0..{world})"
            )));
        }
        let comm_id = match crate::params::env_var("COMM_ID") {
            Some((_, v)) => v,
            None => format!("{}:{}", var("MASTER_ADDR")?, var("MASTER_PORT")?),
        };
        let id = crate::bootstrap::UniqueId::from_comm_id(&comm_id)?;
        let ngpu = Device::cuda_count();
        let device = if ngpu > 0 {
            Device::Cuda(local % ngpu)
        } else {
            Device::Cpu(local)
        };
        Comm::init_rank(world, &id, rank, device)
    }
}
