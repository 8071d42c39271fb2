//! Finalize and destroy: destroy waits for queued work; finalize is collective on `init_rank`
//! communicators and local on `init_all` ones, and only destroy is allowed after it; the handle
//! layer's C27 checks (a second destroy, a call after destroy or abort, a value never handed out).
use crate::all_reduce_u32;
use crate::common::{self, on_threads};
use oxccl::bootstrap::get_unique_id;
use oxccl::{Comm, CommHandle, DataType, Device, Error, RedOp};

#[test]
fn destroy_waits_for_queued_work_and_returns_ok() {
    let comms = common::init_comms(&Device::cpus(2), None);
    let streams: Vec<_> = comms.iter().map(|c| c.device().new_stream().unwrap()).collect();
    let bufs: Vec<_> = comms.iter().map(|c| c.device().alloc(4 << 20).unwrap()).collect();
    for (r, c) in comms.iter().enumerate() {
        bufs[r]
            .write(0, &((r + 1) as f32).to_ne_bytes().repeat(1 << 20))
            .unwrap();
        c.all_reduce(
            &bufs[r],
            &bufs[r],
            1 << 20,
            DataType::F32,
            RedOp::Sum,
            &streams[r],
        )
        .unwrap();
    }
    // No synchronize: destroy itself waits for the queued AllReduce of each rank.
    for c in comms {
        c.destroy().unwrap();
    }
    for (s, b) in streams.iter().zip(&bufs) {
        s.synchronize().unwrap();
        assert!(
            b.to_vec()
                .unwrap()
                .chunks(4)
                .all(|x| f32::from_ne_bytes(x.try_into().unwrap()) == 3.0)
        );
    }
}

#[test]
fn finalize_then_destroy() {
    let _env = common::env::shared();
    // init_rank: finalize is collective (a barrier), destroy afterwards is local.
    let id = get_unique_id().unwrap();
    let out = on_threads(2, |r| {
        let c = Comm::init_rank(2, &id, r, Device::Cpu(r)).unwrap();
        let sum = all_reduce_u32(&c, 1000);
        assert!(!c.is_finalized());
        c.finalize().unwrap();
        c.finalize().unwrap();
        assert!(c.is_finalized());
        let stream = c.device().new_stream().unwrap();
        let buf = c.device().alloc(16).unwrap();
        let e = c
            .all_reduce(&buf, &buf, 4, DataType::U32, RedOp::Sum, &stream)
            .unwrap_err();
        c.destroy().unwrap();
        (sum, e.to_string())
    });
    for (r, (sum, e)) in out.into_iter().enumerate() {
        // 1 + 2 = 3 everywhere.
        assert!(sum.iter().all(|&x| x == 3));
        assert_eq!(
            e,
            format!(
                "invalid usage: rank {r}: the communicator was finalized; only destroy is allowed after finalize"
            )
        );
    }
    // init_all: finalize waits for this rank's work only.
    let comms = Comm::init_all(&Device::cpus(2)).unwrap();
    on_threads(2, |r| all_reduce_u32(&comms[r], 10));
    for c in &comms {
        c.finalize().unwrap();
    }
    for c in comms {
        c.destroy().unwrap();
    }
}

#[test]
fn handle_layer_detects_double_destroy_and_use_after_destroy_c27() {
    let _env = common::env::shared();
    for nranks in [1usize, 2] {
        let handles: Vec<CommHandle> = Comm::init_all(&Device::cpus(nranks))
            .unwrap()
            .into_iter()
            .map(CommHandle::new)
            .collect();
        for h in &handles {
            assert_eq!(h.with(|c| Ok(c.count())).unwrap(), nranks);
        }
        for h in &handles {
            h.destroy().unwrap();
        }
        for h in &handles {
            let e = h.destroy().unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
            assert_eq!(
                e.to_string(),
                format!(
                    "invalid argument: comm handle {:#x} was already destroyed (a second destroy, or a call after destroy or abort)",
                    h.to_raw()
                )
            );
            let e = h
                .with(|c| {
                    let s = c.device().new_stream()?;
                    let b = c.device().alloc(4)?;
                    c.all_reduce(&b, &b, 1, DataType::F32, RedOp::Sum, &s)
                })
                .unwrap_err();
            assert!(e.to_string().contains("was already destroyed"), "{e}");
        }
    }
    // Abort frees the communicator too.
    let h = CommHandle::new(Comm::init_all(&Device::cpus(1)).unwrap().remove(0));
    h.abort().unwrap();
    assert!(h.get().unwrap_err().to_string().contains("was already destroyed"));
    // A value never handed out.
    let e = CommHandle::from_raw(0x1234).get().unwrap_err();
    assert_eq!(
        e.to_string(),
        "invalid argument: comm handle 0x1234 is not a communicator of this process (never created here)"
    );
}
