//! The call-signature check (`OXCCL_CHECK_CALLS=1`) of ranks in processes on simulated hosts
//! (`OXCCL_HOSTID`), where it gathers the signatures over a channel of its own, with scripted
//! ranks (`script_ranks`).
use crate::script_ranks::{finish, show, start, steps};
use std::time::Duration;

/// A send that completes without its receive (64 bytes fit the FIFO, as in NCCL), then an
/// AllReduce every rank calls, then the receive: a valid program, exact with the check on. The
/// send waits in the point-to-point channel to rank + 1 while the AllReduce's check gathers: on
/// a channel of the check's own, they never meet (on the point-to-point channel the signature
/// read the send's bytes and the ranks timed out). Two ranks on two hosts, and three on two (the
/// third rank calls the AllReduce only).
#[test]
fn a_send_waiting_for_its_receive_does_not_meet_the_checks_gather() {
    for hosts in [&["ca", "cb"][..], &["ca", "ca", "cb"]] {
        let scripts = ["send 64; ar 64; async", "ar 64; recv 64; async", "ar 64; async"];
        let envs: Vec<_> = hosts
            .iter()
            .map(|h| {
                vec![
                    ("OXCCL_CHECK_CALLS", "1".to_string()),
                    ("OXCCL_TIMEOUT", "10".to_string()),
                    ("OXCCL_HOSTID", format!("{h}-{}", hosts.len())),
                ]
            })
            .collect();
        let mut ranks = start(&scripts[..hosts.len()], &envs);
        let outs = finish(&mut ranks, Duration::from_secs(60));
        let all = show(&outs);
        let want: [&[&str]; 3] = [
            &["init OK", "send 64 OK", "ar 64 OK", "async OK"],
            &["init OK", "ar 64 OK", "recv 64 OK", "async OK"],
            &["init OK", "ar 64 OK", "async OK"],
        ];
        for (r, (ok, out)) in outs.iter().enumerate() {
            assert!(*ok, "{hosts:?}: {all}");
            assert_eq!(steps(out), want[r], "{hosts:?}, rank {r}: {all}");
        }
    }
}
