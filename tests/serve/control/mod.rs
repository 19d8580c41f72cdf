//! `serve --control`: exports added and deleted while the server runs, through the QMP-style
//! socket and `qcow2-nbd ctl`, seen by real clients (nbdinfo, qemu-io, fio) and by a raw
//! client that stays attached; images closed, checked and unlocked once deleted; hostile
//! control input answered with QEMU's error classes while the exports go on being served.
//!
//! By command family: exports added and deleted (`add_delete`), the same with worker threads
//! (`threads`), dirty bitmaps (`bitmaps`), hostile control input and the socket's path
//! (`hostile`), files that are no disk or never answer (`opens`), and a thousand rounds of
//! adds and deletes (`endurance`); the clients and the server they share are in `harness`.

mod add_delete;
mod bitmaps;
mod endurance;
mod harness;
mod hostile;
mod opens;
mod threads;
