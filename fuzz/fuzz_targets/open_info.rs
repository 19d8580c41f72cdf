//! Open these bytes as an image and print info (human and JSON), exactly the code path of
//! `qcow2-nbd info`, plus the L1 and refcount tables.
#![no_main]

use libfuzzer_sys::fuzz_target;
use qcow2::inspect::{self, ImageInfo};

fuzz_target!(|data: &[u8]| {
    let Ok(meta) = inspect::inspect(data) else {
        return;
    };
    let info = ImageInfo::from_metadata(&meta, "fuzz.qcow2");
    let human = info.to_human();
    assert!(human.starts_with("image: fuzz.qcow2\n"));
    let json = serde_json::to_string(&info).expect("the report serializes");
    assert!(json.contains("\"virtual-size\""));
    let _ = inspect::read_l1_table(data, &meta.header);
    let _ = inspect::read_refcount_table(data, &meta.header);
});
