//! qemu-img check's two output formats, byte for byte: the human summary and the JSON object
//! (in QEMU's key order, with optional counts only when non-zero).

use super::report::CheckReport;
use super::run::CheckOutcome;
use crate::qemu_json::string as json_string;

impl CheckReport {
    /// The human summary qemu-img prints on stdout.
    pub fn to_human(&self) -> String {
        let mut out = String::new();
        if self.corruptions == 0 && self.leaks == 0 && self.check_errors == 0 {
            out.push_str("No errors were found on the image.\n");
        } else {
            if self.corruptions > 0 {
                out.push_str(&format!(
                    "\n{} errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.\n",
                    self.corruptions
                ));
            }
            if self.leaks > 0 {
                out.push_str(&format!(
                    "\n{} leaked clusters were found on the image.\nThis means waste of disk space, but no harm to data.\n",
                    self.leaks
                ));
            }
            if self.check_errors > 0 {
                out.push_str(&format!(
                    "\n{} internal errors have occurred during the check.\n",
                    self.check_errors
                ));
            }
        }
        if self.total_clusters != 0 && self.allocated_clusters != 0 {
            let allocated = self.allocated_clusters as f64;
            out.push_str(&format!(
                "{}/{} = {:.2}% allocated, {:.2}% fragmented, {:.2}% compressed clusters\n",
                self.allocated_clusters,
                self.total_clusters,
                allocated * 100.0 / self.total_clusters as f64,
                self.fragmented_clusters as f64 * 100.0 / allocated,
                self.compressed_clusters as f64 * 100.0 / allocated,
            ));
        }
        if self.image_end_offset != 0 {
            out.push_str(&format!("Image end offset: {}\n", self.image_end_offset));
        }
        out
    }

    /// The JSON object qemu-img prints with `--output=json` for `filename`.
    pub fn to_json(&self, filename: &str) -> String {
        // QEMU's dictionary iterates in hash-bucket order; every key has its own bucket, so
        // the order is fixed.
        let optional = |v: u64| (v != 0).then_some(v.to_string());
        let fields: [(&str, Option<String>); 12] = [
            ("image-end-offset", optional(self.image_end_offset)),
            ("compressed-clusters", optional(self.compressed_clusters)),
            ("total-clusters", optional(self.total_clusters)),
            ("corruptions", optional(self.corruptions)),
            ("corruptions-fixed", optional(self.corruptions_fixed)),
            ("check-errors", Some(self.check_errors.to_string())),
            ("leaks", optional(self.leaks)),
            ("leaks-fixed", optional(self.leaks_fixed)),
            ("allocated-clusters", optional(self.allocated_clusters)),
            ("filename", Some(json_string(filename))),
            ("format", Some(json_string("qcow2"))),
            ("fragmented-clusters", optional(self.fragmented_clusters)),
        ];
        let body: Vec<String> = fields
            .iter()
            .filter_map(|(k, v)| v.as_ref().map(|v| format!("    \"{k}\": {v}")))
            .collect();
        format!("{{\n{}\n}}\n", body.join(",\n"))
    }
}

impl CheckOutcome {
    /// What qemu-img prints on stdout in human mode: the repair summary when the image was
    /// repaired and checked again, then the report.
    pub fn to_human(&self) -> String {
        let mut out = String::new();
        if self.rechecked {
            out.push_str(&format!(
                "The following inconsistencies were found and repaired:\n\n    {} leaked clusters\n    {} corruptions\n\nDouble checking the fixed image now...\n",
                self.report.leaks_fixed, self.report.corruptions_fixed
            ));
        }
        out.push_str(&self.report.to_human());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_has_qemu_key_order_and_omits_zero_counts() {
        let r = CheckReport {
            image_end_offset: 94208,
            total_clusters: 256,
            corruptions: 2,
            leaks: 1,
            allocated_clusters: 16,
            ..CheckReport::default()
        };
        assert_eq!(
            r.to_json("t.qcow2"),
            "{\n    \"image-end-offset\": 94208,\n    \"total-clusters\": 256,\n    \"corruptions\": 2,\n    \"check-errors\": 0,\n    \"leaks\": 1,\n    \"allocated-clusters\": 16,\n    \"filename\": \"t.qcow2\",\n    \"format\": \"qcow2\"\n}\n"
        );
    }

    #[test]
    fn human_summary_matches_qemu_wording() {
        let r = CheckReport {
            image_end_offset: 94208,
            total_clusters: 256,
            corruptions: 2,
            allocated_clusters: 16,
            ..CheckReport::default()
        };
        let o = CheckOutcome {
            report: CheckReport {
                leaks_fixed: 1,
                ..r
            },
            rechecked: true,
        };
        assert_eq!(
            o.to_human(),
            "The following inconsistencies were found and repaired:\n\n    1 leaked clusters\n    0 corruptions\n\nDouble checking the fixed image now...\n\n2 errors were found on the image.\nData may be corrupted, or further writes to the image may corrupt it.\n16/256 = 6.25% allocated, 0.00% fragmented, 0.00% compressed clusters\nImage end offset: 94208\n"
        );
    }

    #[test]
    fn json_strings_are_escaped_like_qemu() {
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\n\"");
        assert_eq!(json_string("é😀"), "\"\\u00E9\\uD83D\\uDE00\"");
    }

    #[test]
    fn exit_codes_follow_qemu_img() {
        let mut r = CheckReport::default();
        assert_eq!(r.exit_code(), 0);
        r.leaks = 1;
        assert_eq!(r.exit_code(), 3);
        r.corruptions = 1;
        assert_eq!(r.exit_code(), 2);
        r.check_errors = 1;
        assert_eq!(r.exit_code(), 1);
    }
}
