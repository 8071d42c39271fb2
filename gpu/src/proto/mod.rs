//! Protocols: each is one implementation of the [`Primitives`] verbs over a connection FIFO.
//!
//! Mirrors NCCL's `primitives.h`: algorithms (`crate::coll`) call only these verbs and never touch
//! flags, FIFOs or head/tail; a protocol never knows which collective is running. Offsets and
//! counts are in elements of `T`, relative to the operation's `sendbuff` (input) and `recvbuff`
//! (output). A verb moves `n` elements through as many FIFO steps as it needs; sender and receiver
//! compute the same steps from the same `n`.

pub mod ll;
pub mod ll128;
pub mod simple;

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
}
