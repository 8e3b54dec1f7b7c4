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

#[test]
fn sha256_known_answers() {
    // FIPS 180-2 examples: empty, one block, two blocks; and one whose padding spills over.
    assert_eq!(
        sha256_hex(b""),
        "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    );
    assert_eq!(
        sha256_hex(b"abc"),
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    );
    assert_eq!(
        sha256_hex(b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"
    );
    assert_eq!(
        sha256_hex(&[b'a'; 1000]),
        "41edece42d63e8d9bf515a9ba6932e1c20cbc9f5a5d134645adb5db1b9737ea3"
    );
}

/// SHA-256 (FIPS 180-4), hex: what `sha256sum` prints, which the script records. Written out
/// here so that the check needs neither a crate nor a tool on the test machine.
fn sha256_hex(data: &[u8]) -> String {
    // First 32 bits of the fractional parts of the cube roots of the first 64 primes.
    const K: [u32; 64] = [
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2,
    ];
    // First 32 bits of the fractional parts of the square roots of the first 8 primes.
    let mut h: [u32; 8] = [
        0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab,
        0x5be0cd19,
    ];
    // Padding: a 1 bit, zeros up to 56 mod 64 bytes, then the length in bits, big-endian.
    let mut msg = data.to_vec();
    let bits = (data.len() as u64).wrapping_mul(8);
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&bits.to_be_bytes());

    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 64];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..64 {
            let s0 = w[i - 15].rotate_right(7) ^ w[i - 15].rotate_right(18) ^ (w[i - 15] >> 3);
            let s1 = w[i - 2].rotate_right(17) ^ w[i - 2].rotate_right(19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16]
                .wrapping_add(s0)
                .wrapping_add(w[i - 7])
                .wrapping_add(s1);
        }
        let [mut a, mut b, mut c, mut d, mut e, mut f, mut g, mut hh] = h;
        for i in 0..64 {
            let s1 = e.rotate_right(6) ^ e.rotate_right(11) ^ e.rotate_right(25);
            let ch = (e & f) ^ (!e & g);
            let t1 = hh
                .wrapping_add(s1)
                .wrapping_add(ch)
                .wrapping_add(K[i])
                .wrapping_add(w[i]);
            let s0 = a.rotate_right(2) ^ a.rotate_right(13) ^ a.rotate_right(22);
            let maj = (a & b) ^ (a & c) ^ (b & c);
            let t2 = s0.wrapping_add(maj);
            hh = g;
            g = f;
            f = e;
            e = d.wrapping_add(t1);
            d = c;
            c = b;
            b = a;
            a = t1.wrapping_add(t2);
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e, f, g, hh]) {
            *x = x.wrapping_add(y);
        }
    }
    h.iter().map(|x| format!("{x:08x}")).collect()
}
