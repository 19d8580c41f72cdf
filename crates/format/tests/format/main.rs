//! The pure format layer: round trips and sanity limits; one test binary so the suite links once.

mod limits_negative;
mod roundtrip_props;
