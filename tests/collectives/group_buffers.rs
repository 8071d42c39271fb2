//! Buffers and streams dropped while a group still holds calls on them. A send or receive inside
//! `group_start`/`group_end` borrows its buffer and stream only for the call, but runs at the
//! outermost end: a buffer dropped in between must not be freed under it (a later allocation at
//! its address would be read or overwritten, or a freed mapping touched), nor a stream destroyed
//! before its work is queued. On the CPU target (every run) the buffers are 48 MiB, above the C
//! allocator's largest mapping threshold, so a buffer freed too early is unmapped and the
//! group's copy into it would fault at once; on a GPU (2 GPUs, or GPU 0 shared by 2 ranks) a
//! buffer allocated after the drops would take a freed one's address.
use crate::common;

use oxccl::{DataType, Device, DeviceBuffer};
use std::time::Duration;

const BYTES: usize = 48 << 20;

fn pattern(seed: u8) -> Vec<u8> {
    (0..BYTES)
        .map(|i| (i as u32).wrapping_mul(2654435761).rotate_left(seed as u32) as u8)
        .collect()
}

/// One thread drives both ranks: rank 0 sends to rank 1 and rank 1 sends to rank 0; every
/// buffer of the group is dropped before `group_end` except rank `kept_recv_rank`'s receive
/// buffer, which must hold what its peer sent, and with `drop_streams` the streams too. The
/// dropped ones are freed once the group's work is done.
fn exchange_dropping_all_but(devices: &[Device], kept_recv_rank: usize, drop_streams: bool) {
    let comms = common::init_comms(devices, None);
    let mut streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
    let sends: Vec<DeviceBuffer> = (0..2)
        .map(|r| {
            let b = comms[r].device().alloc(BYTES).unwrap();
            b.write(0, &pattern(r as u8 + 1)).unwrap();
            b
        })
        .collect();
    let recvs: Vec<DeviceBuffer> = (0..2).map(|r| comms[r].device().alloc(BYTES).unwrap()).collect();
    oxccl::group_start().unwrap();
    for r in 0..2 {
        comms[r]
            .send(&sends[r], BYTES, DataType::U8, 1 - r, &streams[r])
            .unwrap();
        comms[r]
            .recv(&recvs[r], BYTES, DataType::U8, 1 - r, &streams[r])
            .unwrap();
    }
    drop(sends);
    if drop_streams {
        streams.clear();
    }
    let mut kept = None;
    for (r, b) in recvs.into_iter().enumerate() {
        if r == kept_recv_rank {
            kept = Some(b);
        }
    }
    // Memory allocated now may not reuse the dropped buffers' addresses while the group holds
    // them.
    let fresh: Vec<DeviceBuffer> = (0..2).map(|r| comms[r].device().alloc(BYTES).unwrap()).collect();
    for f in &fresh {
        f.fill(0x5a).unwrap();
    }
    oxccl::group_end().unwrap();
    for s in &streams {
        s.synchronize().unwrap();
    }
    for c in &comms {
        assert!(
            c.wait_idle(Duration::from_secs(30)).unwrap(),
            "rank {}: the group's work did not finish",
            c.rank()
        );
    }
    let got = kept.unwrap().to_vec().unwrap();
    let want = pattern(2 - kept_recv_rank as u8);
    let wrong = got.iter().zip(&want).filter(|(g, w)| g != w).count();
    assert_eq!(
        wrong, 0,
        "rank {kept_recv_rank}'s receive: {wrong} wrong bytes of {BYTES}"
    );
    for (r, f) in fresh.iter().enumerate() {
        let bad = f.to_vec().unwrap().iter().filter(|&&b| b != 0x5a).count();
        assert_eq!(
            bad, 0,
            "rank {r}: {bad} bytes of a buffer allocated after the drops were written by the group"
        );
    }
}

#[test]
fn buffers_dropped_before_the_group_ends_stay_allocated_until_its_work_is_done() {
    let devices = Device::cpus(2);
    exchange_dropping_all_but(&devices, 1, false);
    exchange_dropping_all_but(&devices, 0, true);
}

#[test]
fn buffers_and_streams_dropped_before_the_group_ends_outlive_its_work_gpu() {
    let test = "buffers_and_streams_dropped_before_the_group_ends_outlive_its_work_gpu";
    let _gpu = common::gpu_lock();
    let Some(devices) = common::two_ranks_or_skip(test) else {
        return;
    };
    exchange_dropping_all_but(&devices, 1, false);
    exchange_dropping_all_but(&devices, 0, true);
}
