//! The storage seam: async positional I/O over files (io_uring, threads), memory and faults.
