//! Opening input files (models, external data, checkpoints, data, state) safely: only
//! regular files. Opening a FIFO for reading blocks until some process writes to it (for
//! ever, when none does), and a device or a directory is no input either, so every reader
//! goes through [`open_regular`] or [`read_regular`], which look at the file's type before
//! opening it (`stat` never blocks) and again on the open file.

use std::fs::File;
use std::io::{self, Read};
use std::path::Path;

/// What a path names when it is not a regular file, for messages.
fn kind_of(meta: &std::fs::Metadata) -> &'static str {
    let t = meta.file_type();
    if t.is_dir() {
        return "a directory";
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return "a FIFO (named pipe)";
        }
        if t.is_socket() {
            return "a socket";
        }
        if t.is_char_device() {
            return "a character device";
        }
        if t.is_block_device() {
            return "a block device";
        }
    }
    "not a regular file"
}

fn not_regular(meta: &std::fs::Metadata) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidInput,
        format!(
            "{}; only regular files are read (a pipe or device could block for ever)",
            kind_of(meta)
        ),
    )
}

/// Opens `path` for reading when it is a regular file (after following symlinks); any
/// other kind of file is an `InvalidInput` error saying what it is, and is never opened.
pub fn open_regular(path: &Path) -> io::Result<File> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    let file = File::open(path)?;
    // The path may have been replaced between the two looks: check what was opened.
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(not_regular(&meta));
    }
    Ok(file)
}

/// The whole content of the regular file `path` ([`open_regular`]).
pub fn read_regular(path: &Path) -> io::Result<Vec<u8>> {
    let mut file = open_regular(path)?;
    let len = file.metadata()?.len();
    let mut bytes = Vec::with_capacity(usize::try_from(len).unwrap_or(0));
    file.read_to_end(&mut bytes)?;
    Ok(bytes)
}

/// The content of the regular file `path` as UTF-8 text ([`open_regular`]).
pub fn read_regular_to_string(path: &Path) -> io::Result<String> {
    String::from_utf8(read_regular(path)?)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
}

/// The bytes that reading input data may allocate: `ONNX_GA_MEMORY_LIMIT` (bytes) when
/// set, else the memory the kernel estimates available (`MemAvailable` of /proc/meminfo,
/// and the cgroup's `memory.max` less its use, whichever is smaller); `None` where none of
/// these is known.
pub fn memory_budget() -> Option<u64> {
    if let Some(limit) = std::env::var("ONNX_GA_MEMORY_LIMIT")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
    {
        return Some(limit);
    }
    let meminfo = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| {
            let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
            let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
            kib.checked_mul(1024)
        });
    let read = |f: &str| -> Option<u64> {
        std::fs::read_to_string(format!("/sys/fs/cgroup/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let cgroup =
        read("memory.max").map(|max| max.saturating_sub(read("memory.current").unwrap_or(0)));
    match (meminfo, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The bytes of raw data a tensor of `dims` and ONNX element type `data_type` holds;
/// `None` for strings, unknown types, negative dims or a product that overflows.
pub fn tensor_byte_len(dims: &[i64], data_type: i32) -> Option<u64> {
    let count = dims
        .iter()
        .try_fold(1u64, |n, d| n.checked_mul(u64::try_from(*d).ok()?))?;
    // (bits per element) by TensorProto.DataType.
    let bits: u64 = match data_type {
        2 | 3 | 9 | 17..=20 => 8,
        4 | 5 | 10 | 16 => 16,
        1 | 6 | 12 => 32,
        7 | 11 | 13 | 14 => 64,
        15 => 128,
        21..=23 | 25 | 26 => 4,
        _ => return None,
    };
    count.checked_mul(bits).map(|b| b.div_ceil(8))
}
