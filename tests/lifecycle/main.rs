//! Communicator lifecycle on the CPU target (GPU parts skip with the reason printed): init and
//! its errors, with the accessors and error strings (`init`), and inside a group (`group_init`); abort, from any thread or rank, and
//! the async errors it and a dead peer leave (`abort`); finalize and destroy, the handle layer's
//! double-destroy checks (`teardown`); calls that make no progress time out (`timeout`); ranks that issued different calls fail them naming the difference (`call_check`); the flight recorder's sends and receives, matched by `oxccl trace` (`flight_recorder`); 200 init/destroy cycles back to the baseline of threads,
//! descriptors and GPU memory (`cycles`); and CPU-target device memory whose free waits for the
//! work queued before it (`buffers`).
#[macro_use]
#[path = "../common/mod.rs"]
mod common;

mod abort;
mod buffers;
mod call_check;
mod cycles;
mod flight_recorder;
mod group_init;
mod init;
mod split;
mod teardown;
mod timeout;

use common::child;
use oxccl::{Comm, DataType, RedOp};
use std::process::Stdio;
use std::time::Duration;

/// One AllReduce of `count` u32 (rank r contributes r + 1) on `comm`; returns the result.
pub fn all_reduce_u32(comm: &Comm, count: usize) -> Vec<u32> {
    let dev = comm.device();
    let stream = dev.new_stream().unwrap();
    let buf = dev.alloc(count * 4).unwrap();
    buf.write(0, &((comm.rank() + 1) as u32).to_ne_bytes().repeat(count))
        .unwrap();
    comm.all_reduce(&buf, &buf, count, DataType::U32, RedOp::Sum, &stream)
        .unwrap();
    stream.synchronize().unwrap();
    buf.to_vec()
        .unwrap()
        .chunks(4)
        .map(|c| u32::from_ne_bytes(c.try_into().unwrap()))
        .collect()
}

/// Runs the child entry `entry` ([`child_entry!`]) with `envs` set, its stderr shown with the
/// test's; returns (success, stdout) once it exits, killed at `limit`.
pub fn run_child(entry: &str, envs: &[(&str, String)], limit: Duration) -> (bool, String) {
    let mut cmd = child::command(entry);
    cmd.stderr(Stdio::inherit());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    child::run(&mut cmd, limit)
}
