//! The points at which a format driver announces what it is about to do to its file
//! ([`crate::Storage::event`]), by QEMU's names for them: the `blkdebug` wrapper
//! ([`crate::blkdebug`]) fails chosen I/O once one is announced, every other storage ignores
//! them.

macro_rules! events {
    ($($variant:ident => $name:literal,)*) => {
        /// The points at which a format driver announces what it is about to do, by QEMU's
        /// names for them.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum Event {
            $(
                #[doc = concat!("`", $name, "`")]
                $variant,
            )*
        }

        impl Event {
            /// Every event, in QEMU's order.
            pub const ALL: &'static [Event] = &[$(Event::$variant,)*];

            /// QEMU's name of the event.
            pub fn name(self) -> &'static str {
                match self {
                    $(Event::$variant => $name,)*
                }
            }

            /// The event QEMU names `name`.
            pub fn from_name(name: &str) -> Option<Event> {
                match name {
                    $($name => Some(Event::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

events! {
    L1Update => "l1_update",
    L1GrowAllocTable => "l1_grow_alloc_table",
    L1GrowWriteTable => "l1_grow_write_table",
    L1GrowActivateTable => "l1_grow_activate_table",
    L2Load => "l2_load",
    L2Update => "l2_update",
    L2UpdateCompressed => "l2_update_compressed",
    L2AllocCowRead => "l2_alloc_cow_read",
    L2AllocWrite => "l2_alloc_write",
    ReadAio => "read_aio",
    ReadBackingAio => "read_backing_aio",
    ReadCompressed => "read_compressed",
    WriteAio => "write_aio",
    WriteCompressed => "write_compressed",
    VmstateLoad => "vmstate_load",
    VmstateSave => "vmstate_save",
    CowRead => "cow_read",
    CowWrite => "cow_write",
    ReftableLoad => "reftable_load",
    ReftableGrow => "reftable_grow",
    ReftableUpdate => "reftable_update",
    RefblockLoad => "refblock_load",
    RefblockUpdate => "refblock_update",
    RefblockUpdatePart => "refblock_update_part",
    RefblockAlloc => "refblock_alloc",
    RefblockAllocHookup => "refblock_alloc_hookup",
    RefblockAllocWrite => "refblock_alloc_write",
    RefblockAllocWriteBlocks => "refblock_alloc_write_blocks",
    RefblockAllocWriteTable => "refblock_alloc_write_table",
    RefblockAllocSwitchTable => "refblock_alloc_switch_table",
    ClusterAlloc => "cluster_alloc",
    ClusterAllocBytes => "cluster_alloc_bytes",
    ClusterFree => "cluster_free",
    FlushToOs => "flush_to_os",
    FlushToDisk => "flush_to_disk",
    PwritevRmwHead => "pwritev_rmw_head",
    PwritevRmwAfterHead => "pwritev_rmw_after_head",
    PwritevRmwTail => "pwritev_rmw_tail",
    PwritevRmwAfterTail => "pwritev_rmw_after_tail",
    Pwritev => "pwritev",
    PwritevZero => "pwritev_zero",
    PwritevDone => "pwritev_done",
    EmptyImagePrepare => "empty_image_prepare",
    L1ShrinkWriteTable => "l1_shrink_write_table",
    L1ShrinkFreeL2Clusters => "l1_shrink_free_l2_clusters",
    CorWrite => "cor_write",
    ClusterAllocSpace => "cluster_alloc_space",
    None => "none",
}
