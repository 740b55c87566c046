//! Helpers shared by the integration tests (see tests/*.rs).
