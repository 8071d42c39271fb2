//! The connections of the flag-line protocols (LL, LL128) as a fan of peers (NCCL's
//! `FanAsymmetric<MaxRecv, MaxSend>` with the per-peer `ncclConnInfo` a Primitives object loads):
//! up to `NR` receive and `NS` send connections, the present ones first. A ring channel is a fan
//! of one and one (prev, next); a tree's reduce phase receives from up to
//! [`MAX_TREE_ARITY`] children and sends to the parent, its broadcast phase the reverse.
//!
//! What the two protocols share lives here: loading the connections, the send credit (thread 0
//! waits until every send peer freed the slot: `head + FIFO_STEPS ≥ step + 1`), freeing the
//! received slots (`head = step + 1`), advancing the steps and storing them back for the next
//! kernel. Every per-peer loop goes through [`each_peer`], so peer indices are constants on the
//! GPU and nothing lands in local memory.
use super::each_peer;
use crate::abi::{
    ConnInfo, DevChannel, DevTree, FIFO_STEPS, MAX_TREE_ARITY, Proto, SPINS_BEFORE_CHECK_ABORT,
};
use crate::arch;

/// A list of connections (the first `.1` of `.0` are present).
pub type ConnList = ([*mut ConnInfo; MAX_TREE_ARITY], usize);

/// Where a primitives object's connections come from.
#[derive(Clone, Copy)]
pub enum Peers {
    /// A ring channel: receive from prev, send to next.
    Ring(*mut DevChannel),
    /// One phase of a channel's tree: `true` = the reduce phase (children → parent), `false` =
    /// the broadcast phase (parent → children); see [`super::tree_conns`].
    Tree(*mut DevTree, bool),
}

impl Peers {
    /// The receive and send connection lists.
    ///
    /// # Safety
    /// The channel or tree is set up.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub unsafe fn lists(self) -> (ConnList, ConnList) {
        let null = core::ptr::null_mut();
        // SAFETY: caller guarantees the channel / tree; only field addresses are taken.
        unsafe {
            match self {
                Peers::Ring(c) => (
                    ([&raw mut (*c).recv, null, null], 1),
                    ([&raw mut (*c).send, null, null], 1),
                ),
                Peers::Tree(t, up) => {
                    let (rp, nr, sp, ns) = super::tree_conns(t, up);
                    ((rp, nr), (sp, ns))
                }
            }
        }
    }
}

/// Whether the communicator whose abort line is at `flag` (0: none) was stopped: the line's
/// abort flag (`u32` at +0: `Comm::abort`, a timeout, a failed peer) or its stop word (`u32` at
/// [`crate::abi::ABORT_LINE_STOP`]: this rank's call check found the ranks' calls different).
/// One 8-byte load of host-mapped memory on the GPU (the flag's own load before the stop word
/// existed, widened: a wider or second load measurably slowed LL128 loops); polled by every
/// spin loop of the primitives.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn abort_raised(flag: *const u32) -> bool {
    if flag.is_null() {
        return false;
    }
    // SAFETY: `flag` is an 8-byte aligned abort line of at least 8 bytes (the primitives'
    // constructor contract, `DevComm::abort_flag`).
    unsafe { arch::load_volatile_u64(flag as *const u64) != 0 }
}

/// Device-side state of one connection for the duration of a kernel; `B` is the protocol's line
/// unit (the FIFO buffer's element type).
pub struct LineConn<B> {
    pub info: *mut ConnInfo,
    pub buff: *mut B,
    pub head: *mut u64,
    /// Step sizes a proxy reads (`ConnInfo::sizes`); null when none are wanted.
    pub sizes: *mut u64,
    pub step: u64,
}

impl<B> Clone for LineConn<B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B> Copy for LineConn<B> {}

impl<B> LineConn<B> {
    const NONE: Self = LineConn {
        info: core::ptr::null_mut(),
        buff: core::ptr::null_mut(),
        head: core::ptr::null_mut(),
        sizes: core::ptr::null_mut(),
        step: 0,
    };

    /// # Safety
    /// `info` points at a connection set up for `proto`.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    unsafe fn load(info: *mut ConnInfo, proto: Proto) -> Self {
        // SAFETY: caller guarantees `info`.
        let c = unsafe { info.read() };
        LineConn {
            info,
            buff: c.buffs[proto as usize] as *mut B,
            head: c.head as *mut u64,
            sizes: c.sizes as *mut u64,
            step: c.step,
        }
    }
}

/// Up to `NR` receive and `NS` send connections of one protocol.
pub struct Fan<B, const NR: usize, const NS: usize> {
    pub recv: [LineConn<B>; NR],
    /// Receive peers present (the first `nrecv` of `recv`), at most `NR`.
    nrecv: usize,
    pub send: [LineConn<B>; NS],
    /// Send peers present, at most `NS`.
    nsend: usize,
}

impl<B, const NR: usize, const NS: usize> Fan<B, NR, NS> {
    /// Loads the connections of `peers` for `proto`; thread 0 also clears the block's abort word
    /// (`smem[1]`, shared by the threads of a step), then the block synchronises.
    ///
    /// # Safety
    /// The listed connections are set up for `proto`; `smem` is the kernel's shared memory. All
    /// threads of the block call it.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub unsafe fn load(tid: u32, smem: *mut u32, peers: Peers, proto: Proto) -> Self {
        // SAFETY: forwarded caller contract; every thread reaches the barrier.
        unsafe {
            let (r, s) = peers.lists();
            let (nrecv, nsend) = (r.1.min(NR), s.1.min(NS));
            let (mut recv, mut send) = ([LineConn::NONE; NR], [LineConn::NONE; NS]);
            if tid == 0 {
                smem.add(1).write_volatile(0);
            }
            arch::sync_threads();
            each_peer::<NR>(|i| {
                if i < nrecv {
                    recv[i] = LineConn::load(r.0[i], proto);
                }
            });
            each_peer::<NS>(|i| {
                if i < nsend {
                    send[i] = LineConn::load(s.0[i], proto);
                }
            });
            Fan {
                recv,
                nrecv,
                send,
                nsend,
            }
        }
    }

    /// The receive and send peers a verb uses: none on a side it does not use, and on a ring
    /// (one and one, both always present) constants, so the ring's code has no peer counts.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub fn counts<const RECV: bool, const SEND: bool>(&self) -> (usize, usize) {
        let ring = NR == 1 && NS == 1;
        let nrecv = if !RECV {
            0
        } else if ring {
            1
        } else {
            self.nrecv
        };
        let nsend = if !SEND {
            0
        } else if ring {
            1
        } else {
            self.nsend
        };
        (nrecv, nsend)
    }

    /// Thread 0 waits for a free slot on every send peer, then the block learns whether to abort
    /// (through `smem[0]`); true to go on.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub fn wait_send_credit(&self, tid: u32, smem: *mut u32, abort_flag: *const u32) -> bool {
        if tid == 0 {
            let mut ok = true;
            each_peer::<NS>(|i| {
                if i >= self.nsend || !ok {
                    return;
                }
                let (head, want) = (self.send[i].head, self.send[i].step + 1);
                let mut spins = 0u32;
                // SAFETY: `head` is this connection's counter.
                while unsafe { arch::load_volatile_u64(head) } + FIFO_STEPS < want {
                    spins += 1;
                    if spins == SPINS_BEFORE_CHECK_ABORT {
                        spins = 0;
                        if abort_raised(abort_flag) {
                            ok = false;
                            break;
                        }
                    }
                    arch::spin_pause();
                }
            });
            // SAFETY: smem is the kernel's shared memory.
            unsafe { smem.write_volatile(u32::from(!ok)) };
        }
        // SAFETY: all threads execute this with the same control flow.
        unsafe { arch::sync_threads() };
        // SAFETY: written by thread 0 before the barrier.
        (unsafe { smem.read_volatile() }) == 0
    }

    /// Ends a step after the block's barrier: thread 0 frees the slot of the first `nrecv`
    /// receive peers; every thread advances the steps of those and of the first `nsend` send
    /// peers.
    ///
    /// # Safety
    /// Every thread of the block has finished reading the received slots.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub unsafe fn end_step(&mut self, tid: u32, nrecv: usize, nsend: usize) {
        if tid == 0 {
            each_peer::<NR>(|i| {
                if i < nrecv {
                    // SAFETY: the connection's head counter.
                    unsafe { arch::store_volatile_u64(self.recv[i].head, self.recv[i].step + 1) };
                }
            });
        }
        each_peer::<NS>(|i| {
            if i < nsend {
                self.send[i].step += 1;
            }
        });
        each_peer::<NR>(|i| {
            if i < nrecv {
                self.recv[i].step += 1;
            }
        });
    }

    /// Stores the connection steps back for the next kernel (NCCL's Primitives destructor).
    ///
    /// # Safety
    /// All threads of the block call it, once, after the last verb.
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    pub unsafe fn finish(&self, tid: u32) {
        // SAFETY: every thread reaches the barrier; then only thread 0 writes the connections
        // this fan loaded.
        unsafe {
            arch::sync_threads();
            if tid == 0 {
                each_peer::<NR>(|i| {
                    if i < self.nrecv {
                        let c = self.recv[i];
                        (*c.info).step = c.step;
                    }
                });
                each_peer::<NS>(|i| {
                    if i < self.nsend {
                        let c = self.send[i];
                        (*c.info).step = c.step;
                    }
                });
            }
        }
    }
}
