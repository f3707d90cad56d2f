//! The checked-in `openapi/openapi.json` must be the document the code generates, so that
//! clients and reviewers can read the API without building hearth.
//!
//! Regenerate it with `HEARTH_UPDATE_OPENAPI=1 cargo test --release --workspace --test spec_drift`.

use std::path::Path;

#[test]
fn checked_in_spec_matches_the_code() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("openapi.json");
    let generated = format!("{}\n", openapi::spec_json());

    if std::env::var_os("HEARTH_UPDATE_OPENAPI").is_some_and(|v| v == "1") {
        std::fs::write(&path, &generated)
            .unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
        return;
    }

    let checked_in = std::fs::read_to_string(&path).unwrap_or_default();
    if checked_in != generated {
        // The first differing line points at the type whose docs or shape changed.
        let first_difference = checked_in
            .lines()
            .zip(generated.lines())
            .position(|(old, new)| old != new)
            .unwrap_or_else(|| checked_in.lines().count().min(generated.lines().count()));
        panic!(
            "{} is out of date with the wire types (first difference at line {}).\n\
             Regenerate it with: HEARTH_UPDATE_OPENAPI=1 cargo test --release --workspace --test spec_drift\n\
             and commit the result.",
            path.display(),
            first_difference + 1
        );
    }
}
