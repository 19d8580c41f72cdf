//! The pure format layer: round trips, sanity limits and mutated structures; one test binary so the suite links once.

mod limits_negative;
mod mutation;
mod roundtrip_props;
