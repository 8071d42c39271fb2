//! Protocols: each is one implementation of the [`Primitives`] verbs over a connection FIFO.
//!
//! Mirrors NCCL's `primitives.h`: algorithms (`crate::coll`) call only these verbs and never touch
//! flags, FIFOs or head/tail; a protocol never knows which collective is running. Offsets and
//! counts are in elements of `T`, relative to the operation's `sendbuff` (input) and `recvbuff`
//! (output). A verb moves `n` elements through as many FIFO steps as it needs; sender and receiver
//! compute the same steps from the same `n`.

pub mod fan;
pub mod ll;
pub mod ll128;
pub mod simple;
pub mod tree;

/// The data-movement verbs of NCCL's `Primitives` class.
///
/// "recv" reads the FIFO from the ring's previous rank, "send" writes the FIFO to the next one,
/// "reduce" combines received data with input, "copy" writes the output. `post` applies the
/// operation's post-division (Avg) to the value written and sent.
pub trait Primitives {
    /// input[src..src+n] → next.
    fn send(&mut self, src: u64, n: u64);
    /// prev → output[dst..dst+n].
    fn recv(&mut self, dst: u64, n: u64);
    /// prev ⊕ input[src..] → next.
    fn recv_reduce_send(&mut self, src: u64, n: u64);
    /// prev ⊕ input[src..] → output[dst..].
    fn recv_reduce_copy(&mut self, src: u64, dst: u64, n: u64, post: bool);
    /// prev → output[dst..] and next.
    fn recv_copy_send(&mut self, dst: u64, n: u64);
    /// prev ⊕ input[src..] → output[dst..] and next.
    fn recv_reduce_copy_send(&mut self, src: u64, dst: u64, n: u64, post: bool);
    /// input[src..] → output[dst..] and next.
    fn copy_send(&mut self, src: u64, dst: u64, n: u64);
    /// True once the communicator's abort flag was seen; every verb is then a no-op.
    fn aborted(&self) -> bool;
    /// The call check's gate ([`crate::check::gate`]): every algorithm calls it before its first
    /// verb that writes a user buffer (its output, or a peer's through a direct send). False
    /// when the call must stop (a mismatch or an abort): every verb is then a no-op, as after an
    /// abort. Called only in a checked call's kernel (`crate::coll::RingCtx::gate`), with
    /// `seen` as [`crate::check::checked`] returned it.
    fn gate(&mut self, seen: u64) -> bool;
    /// input[src..src+n] → output[dst..dst+n] over no connection: the local copy of a chunk
    /// whose sender sent it before the call check's gate ([`Primitives::sends_to_fifo`]).
    fn copy(&mut self, src: u64, dst: u64, n: u64);
    /// Whether [`Primitives::send`] of up to a chunk writes only its send peers' FIFOs, never a
    /// user buffer, and needs no step of the receiver's kernel (LL and LL128, whose chunk is one
    /// FIFO step, at most two when split, within the slots the previous kernels freed; not
    /// Simple, whose direct sends write the receiver's output): a checked call's sender may then
    /// send before the call check's gate (beyond NCCL; see `crate::coll::ahead_elems`).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn sends_to_fifo(&self) -> bool {
        false
    }

    // Direct verbs (NCCL's `directSend`, `directRecv`, ...): the same data movement, for a send
    // whose receiver only copies the data into its output at offset `dst` (its matching verb is
    // a `direct_recv*` with that `dst`), and a receive whose sender used a `direct_*` send. On a
    // connection with a pointer exchange (`ConnInfo::ptr_exchange`) the Simple protocol writes
    // such data straight into the receiver's output, and the receiver finds it there; every
    // other protocol and connection moves it through the FIFO, as the plain verb does. An
    // algorithm pairs them exactly: each `direct_*` send is received by a `direct_recv*`.

    /// input[src..src+n] → next's output[dst..].
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn direct_send(&mut self, src: u64, _dst: u64, n: u64) {
        self.send(src, n)
    }
    /// input[src..] → output[dst..] and next's output[dst..].
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn direct_copy_send(&mut self, src: u64, dst: u64, n: u64) {
        self.copy_send(src, dst, n)
    }
    /// prev → output[dst..dst+n] (already there when prev wrote it directly).
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn direct_recv(&mut self, dst: u64, n: u64) {
        self.recv(dst, n)
    }
    /// prev → output[dst..] and next's output[dst..].
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn direct_recv_copy_direct_send(&mut self, dst: u64, n: u64) {
        self.recv_copy_send(dst, n)
    }
    /// prev ⊕ input[src..] → output[dst..] and next's output[dst..].
    #[cfg_attr(target_arch = "nvptx64", inline(always))]
    fn recv_reduce_copy_direct_send(&mut self, src: u64, dst: u64, n: u64, post: bool) {
        self.recv_reduce_copy_send(src, dst, n, post)
    }
}

/// [`Primitives::gate`] for a primitive whose block-wide abort state is `aborted`: passes the
/// call check's gate ([`crate::check::gate`]) unless already aborted; a closed gate sets
/// `aborted`, so every later verb is a no-op. Whether the block may go on.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) fn pass_gate(aborted: &mut bool, tid: u32, smem: *mut u32, seen: u64) -> bool {
    // SAFETY: every thread of the block runs the verbs, and so the gate, alike (`aborted` is the
    // block's); `smem` is the kernel's shared memory (the primitives' constructor contract).
    if !*aborted && !unsafe { crate::check::gate(tid, smem, seen) } {
        *aborted = true;
    }
    !*aborted
}

/// [`Primitives::copy`] for a block of `nthreads` threads: `input[src..src+n]` →
/// `output[dst..dst+n]`, elements of `T` (Simple's `reduce_copy` with one source and no
/// operation).
///
/// # Safety
/// Both ranges are valid for `n` elements and do not overlap; every thread of the block calls
/// this.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn local_copy<T: crate::reduce::Elem, Op: crate::reduce::RedFn<T>>(
    tid: u32,
    nthreads: u32,
    input: *const T,
    output: *mut T,
    src: u64,
    dst: u64,
    n: u64,
    args: &crate::reduce::OpArgs,
) {
    // SAFETY: caller contract.
    unsafe {
        simple::reduce_copy::<T, Op, false, false>(
            tid,
            nthreads,
            input.wrapping_add(src as usize) as *const u8,
            core::ptr::null(),
            output.wrapping_add(dst as usize) as *mut u8,
            core::ptr::null_mut(),
            n,
            0,
            simple::PreOn::None,
            args,
        )
    }
}

/// Calls `f(0)`, …, `f(N - 1)` for `N ≤ 3` (a connection fan's peers): written out, so that once
/// inlined every peer index is a constant and per-peer arrays stay in GPU registers (a loop the
/// compiler might not unroll would index them at run time, through local memory).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) fn each_peer<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= crate::abi::MAX_TREE_ARITY) };
    if N > 0 {
        f(0);
    }
    if N > 1 {
        f(1);
    }
    if N > 2 {
        f(2);
    }
}

/// The connections of one phase of a channel's tree (NCCL's Primitives constructor over
/// `tree->down` and `&tree->up`): `up` = the reduce phase, receiving from the children and sending
/// to the parent; else the broadcast phase, the reverse. Returns the receive connections and how
/// many are present, then the send connections and their count (present peers first; the
/// children of `down` are its leading non-negative entries).
///
/// # Safety
/// `tree` points at a set-up [`crate::abi::DevTree`].
#[allow(clippy::type_complexity)]
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) unsafe fn tree_conns(
    tree: *mut crate::abi::DevTree,
    up: bool,
) -> (
    [*mut crate::abi::ConnInfo; crate::abi::MAX_TREE_ARITY],
    usize,
    [*mut crate::abi::ConnInfo; crate::abi::MAX_TREE_ARITY],
    usize,
) {
    let null = core::ptr::null_mut();
    let (mut downs, mut ndown) = ([null; crate::abi::MAX_TREE_ARITY], 0);
    let (mut ups, mut nup) = ([null; crate::abi::MAX_TREE_ARITY], 0);
    // SAFETY: caller guarantees `tree`; only field addresses are taken and plain fields read.
    unsafe {
        each_peer::<{ crate::abi::MAX_TREE_ARITY }>(|i| {
            if ndown == i && (*tree).down[i] >= 0 {
                downs[i] = if up {
                    &raw mut (*tree).recv_down[i]
                } else {
                    &raw mut (*tree).send_down[i]
                };
                ndown = i + 1;
            }
        });
        if (*tree).up >= 0 {
            ups[0] = if up {
                &raw mut (*tree).send_up
            } else {
                &raw mut (*tree).recv_up
            };
            nup = 1;
        }
    }
    if up {
        (downs, ndown, ups, nup)
    } else {
        (ups, nup, downs, ndown)
    }
}

/// Stores how many lines step `step` of a flag-line protocol writes in the connection's step
/// sizes (null: no proxy reads them), tagged with the step ([`crate::abi::lines_step_size`]);
/// called by thread 0 after the slot's credit, before or while the lines are written.
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub(crate) fn announce_step_lines(sizes: *mut u64, step: u64, lines: u64) {
    if sizes.is_null() {
        return;
    }
    let v = crate::abi::lines_step_size(step, lines);
    // SAFETY: a non-null `sizes` holds FIFO_STEPS entries (ConnInfo contract); the credit the
    // caller waited for means the proxy is done with this slot's previous entry.
    unsafe { crate::arch::store_volatile_u64(sizes.add((step % crate::abi::FIFO_STEPS) as usize), v) };
}

/// Elements per step when `n` elements travel in steps of at most `max_step`: the fewest steps,
/// all of equal size except the last (shorter by less than one element per step).
#[cfg_attr(target_arch = "nvptx64", inline(always))]
pub fn balanced_step(n: u64, max_step: u64) -> u64 {
    let max_step = if max_step == 0 { 1 } else { max_step };
    let steps = n.div_ceil(max_step);
    if steps <= 1 { max_step } else { n.div_ceil(steps) }
}

#[cfg(test)]
mod tests {
    use super::balanced_step;

    #[test]
    fn steps_are_balanced_and_never_exceed_the_slot() {
        // 128 Ki elements in steps of at most 120 Ki: two steps of 64 Ki (not 120 Ki + 8 Ki).
        assert_eq!(balanced_step(128 << 10, 120 << 10), 64 << 10);
        assert_eq!(balanced_step(100, 120), 120);
        assert_eq!(balanced_step(0, 120), 120);
        assert_eq!(balanced_step(241, 120), 81);
        for n in [1u64, 7, 119, 120, 121, 1000, 123_457] {
            for max in [1u64, 8, 120, 4096] {
                let s = balanced_step(n, max);
                assert!(s >= 1 && s <= max, "n {n} max {max}: {s}");
                assert_eq!(n.div_ceil(s), n.div_ceil(max), "n {n} max {max}: same step count");
            }
        }
    }
}
