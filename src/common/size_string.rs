//! Size strings on the command line: read by storage's parser (QEMU's rules, which image
//! options share), and worded as qemu-img's commands word a bad number.

pub use storage::size_string::{parse_size, ParseSizeError};

/// Reads a numeric command-line argument the way qemu-img's commands do (a size string,
/// at most `i64::MAX`), with its messages; `what` names the argument in them.
pub fn cvtnum(what: &str, value: &str) -> Result<u64, String> {
    match parse_size(value) {
        Ok(v) if i64::try_from(v).is_ok() => Ok(v),
        Err(ParseSizeError::InvalidSize { .. }) => {
            Err(format!("Invalid {what} specified: '{value}'."))
        }
        _ => Err(format!(
            "Invalid {what} specified. Must be between 0 and {}.",
            i64::MAX
        )),
    }
}
