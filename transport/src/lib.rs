//! Moves activations and control messages between ring neighbours: persistent HTTP/2
//! streams, a frame codec for hidden states, and the control RPCs (clear/truncate a
//! sequence, load a plan), all authenticated by the cluster secret.
//!
//! It moves bytes and frames only: it must not depend on the engine or the server.
//! (Filled in by the ring issue.)
