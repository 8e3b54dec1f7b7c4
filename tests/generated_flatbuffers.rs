//! `src/checkpoint/generated.rs` is what `scripts/gen-checkpoint-fbs.sh` (flatc) makes of
//! `proto/ort_training_checkpoint.fbs` today.
//!
//! Two checks:
//! - Everywhere, CI included (CI machines have no flatc): the generated file's header records
//!   the SHA-256 of the schema it was made from, the SHA-256 of flatc's output (the rest of the
//!   file) and the flatc version. The schema hash must match the schema now, the output hash
//!   the file's body, and the flatc version the `flatbuffers` crate in Cargo.lock. So a schema
//!   edit without regenerating, a hand edit of the generated file, or a crate upgrade without
//!   regenerating fails here on every machine.
//! - Where flatc of the recorded version is installed (`$FLATC`, `.venv-flatc/bin/flatc`, or
//!   `flatc` on PATH, the script's own search order): the script regenerates into a temporary
//!   file, which must equal the checked-in file byte for byte. Where it is not, this part is
//!   skipped with a note on stderr, under `CI=true` too: the hash checks above are what run
//!   there.

use std::path::{Path, PathBuf};
use std::process::Command;

const SCHEMA: &str = "proto/ort_training_checkpoint.fbs";
const GENERATED: &str = "src/checkpoint/generated.rs";
const REGENERATE: &str =
    "regenerate with `bash scripts/gen-checkpoint-fbs.sh` (flatc: see the script's header)";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> Vec<u8> {
    std::fs::read(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// The header line `// {key}: VALUE` of the generated file, and the byte offset just after it.
fn header_value<'a>(generated: &'a str, key: &str) -> (&'a str, usize) {
    let prefix = format!("// {key}: ");
    let mut offset = 0;
    for line in generated.split_inclusive('\n') {
        if !line.starts_with("//") {
            break;
        }
        if let Some(value) = line.strip_prefix(&prefix) {
            return (value.trim_end(), offset + line.len());
        }
        offset += line.len();
    }
    panic!("{GENERATED} has no `{prefix}...` header line: {REGENERATE}");
}

/// The version of the `flatbuffers` crate in Cargo.lock.
fn locked_flatbuffers_version() -> String {
    let lock = String::from_utf8(read("Cargo.lock")).expect("Cargo.lock is UTF-8");
    let mut lines = lock.lines();
    while let Some(line) = lines.next() {
        if line == "name = \"flatbuffers\"" {
            let version = lines.next().unwrap_or_default();
            return version
                .trim_start_matches("version = ")
                .trim_matches('"')
                .to_owned();
        }
    }
    panic!("Cargo.lock has no flatbuffers package");
}

#[test]
fn generated_checkpoint_accessors_match_their_schema() {
    let generated = String::from_utf8(read(GENERATED)).expect("generated file is UTF-8");

    let (schema_sha, _) = header_value(&generated, "schema sha256");
    let actual = sha256_hex(&read(SCHEMA));
    assert_eq!(
        schema_sha, actual,
        "{GENERATED} was generated from another version of {SCHEMA}: {REGENERATE}"
    );

    let (output_sha, body_start) = header_value(&generated, "output sha256");
    let actual = sha256_hex(&generated.as_bytes()[body_start..]);
    assert_eq!(
        output_sha, actual,
        "{GENERATED} differs from what flatc wrote (edited by hand or reformatted?): {REGENERATE}"
    );

    let (flatc, _) = header_value(&generated, "flatc");
    let locked = locked_flatbuffers_version();
    assert_eq!(
        flatc, locked,
        "{GENERATED} was made by flatc {flatc} but Cargo.lock has the flatbuffers crate {locked}; \
         generated code must match the crate: update the script's FLATC_VERSION and {REGENERATE}"
    );
}

/// The flatc the script would use, if it reports `version`.
fn installed_flatc(version: &str) -> Result<PathBuf, String> {
    let candidate = match std::env::var_os("FLATC") {
        Some(f) if !f.is_empty() => PathBuf::from(f),
        _ => {
            let venv = root().join(".venv-flatc/bin/flatc");
            if venv.is_file() {
                venv
            } else {
                PathBuf::from("flatc")
            }
        }
    };
    let out = Command::new(&candidate)
        .arg("--version")
        .output()
        .map_err(|e| format!("{}: {e}", candidate.display()))?;
    let found = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if found == format!("flatc version {version}") {
        Ok(candidate)
    } else {
        Err(format!("{} reports {found:?}", candidate.display()))
    }
}

#[test]
fn generated_checkpoint_accessors_are_what_flatc_writes() {
    let generated = read(GENERATED);
    let text = String::from_utf8_lossy(&generated);
    let (version, _) = header_value(&text, "flatc");
    let flatc = match installed_flatc(version) {
        Ok(f) => f,
        Err(why) => {
            eprintln!(
                "skipping the byte comparison of {GENERATED}: no flatc {version} ({why}); the \
                 header hashes are still checked"
            );
            return;
        }
    };
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("generated.rs");
    let run = Command::new("bash")
        .arg(root().join("scripts/gen-checkpoint-fbs.sh"))
        .arg(&out)
        .env("FLATC", &flatc)
        .current_dir(root())
        .output()
        .expect("running scripts/gen-checkpoint-fbs.sh");
    assert!(
        run.status.success(),
        "scripts/gen-checkpoint-fbs.sh failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let fresh = std::fs::read(&out).expect("the script's output");
    assert!(fresh == generated, "{GENERATED} is stale: {REGENERATE}");
}

/// SHA-256, hex: what `sha256sum` prints, which the script records.
fn sha256_hex(data: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
