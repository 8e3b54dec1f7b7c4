//! The one way onnx-ga writes a file: into a temporary file in the destination folder,
//! fsynced, renamed over the destination, and the folder fsynced. Readers (and a crash at
//! any moment) see the old file or the complete new one, never a partial file; on an error
//! the destination is untouched and the temporary file is removed.
//!
//! The temporary file is created with mode 0666 filtered by the process umask, as any other
//! output, and takes the permissions of the file it replaces when there is one. If the
//! destination is a symlink, the link itself is replaced.
//!
//! [`Staged`] splits the two halves, so that several files can be written completely
//! before any of them appears ([`commit_all`]): `rewrite --split` writes its three models
//! that way.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A file written completely to its temporary name and fsynced, not yet renamed. Dropping
/// it removes the temporary file.
#[derive(Debug)]
pub struct Staged {
    tmp: PathBuf,
    target: PathBuf,
    committed: bool,
}

/// The folder that holds `path` ("." for a bare file name).
pub fn parent_dir(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

static COUNTER: AtomicU64 = AtomicU64::new(0);

/// Creates a fresh temporary file next to `target` (mode 0666 & !umask).
fn create_tmp(target: &Path) -> io::Result<(PathBuf, File)> {
    let dir = parent_dir(target);
    let stem = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    for _ in 0..100 {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let name = format!(".{stem}.{}-{n}-{nanos:x}.onnx-ga.tmp", std::process::id());
        let tmp = dir.join(name);
        let mut options = OpenOptions::new();
        options.write(true).create_new(true);
        #[cfg(unix)]
        {
            use std::os::unix::fs::OpenOptionsExt;
            options.mode(0o666);
        }
        match options.open(&tmp) {
            Ok(file) => return Ok((tmp, file)),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    Err(io::Error::new(
        io::ErrorKind::AlreadyExists,
        "could not find a free temporary file name",
    ))
}

/// Checks that `path` can be written by [`write`]: its folder exists and is a folder,
/// `path` is not a folder, and a file can be created in the folder (tried, then removed).
/// For checking outputs before a long computation.
pub fn check_writable(path: &Path) -> io::Result<()> {
    if path.as_os_str().is_empty() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "empty path"));
    }
    if path.is_dir() {
        return Err(io::Error::other("is a directory"));
    }
    let dir = parent_dir(path);
    match fs::metadata(&dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return Err(io::Error::other(format!(
                "{} is not a directory",
                dir.display()
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("directory {} does not exist", dir.display()),
            ))
        }
        Err(e) => return Err(e),
    }
    let (tmp, file) = create_tmp(path)?;
    drop(file);
    let _ = fs::remove_file(tmp);
    Ok(())
}

impl Staged {
    /// Writes the temporary file for `target` with `write` (a buffered file: `Write` and
    /// `Seek`) and fsyncs it.
    pub fn new(
        target: &Path,
        write: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
    ) -> io::Result<Staged> {
        if target.is_dir() {
            return Err(io::Error::other("is a directory"));
        }
        let (tmp, file) = create_tmp(target)?;
        let staged = Staged {
            tmp,
            target: target.to_path_buf(),
            committed: false,
        };
        let mut writer = BufWriter::new(file);
        write(&mut writer)?;
        let file = writer.into_inner().map_err(|e| e.into_error())?;
        if let Ok(m) = fs::metadata(target) {
            // Replacing a file: keep its permissions. Best effort.
            let _ = file.set_permissions(m.permissions());
        }
        file.sync_all()?;
        Ok(staged)
    }

    /// Where the file goes.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Renames the temporary file over the target and fsyncs the folder.
    pub fn commit(mut self) -> io::Result<()> {
        fs::rename(&self.tmp, &self.target)?;
        self.committed = true;
        sync_dir(&parent_dir(&self.target))
    }
}

impl Drop for Staged {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_file(&self.tmp);
        }
    }
}

/// Fsyncs a folder, so that a rename in it survives a crash. Filesystems that cannot fsync
/// a folder are not an error.
fn sync_dir(dir: &Path) -> io::Result<()> {
    match File::open(dir).and_then(|d| d.sync_all()) {
        Ok(()) => Ok(()),
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::InvalidInput | io::ErrorKind::Unsupported
            ) =>
        {
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Commits staged files, in order. Every file was already written completely, so only a
/// rename can fail here; then the files not yet renamed are removed, and so are those
/// this call renamed into place where no file was before (a file it replaced stays
/// replaced).
pub fn commit_all(staged: Vec<Staged>) -> Result<(), (PathBuf, io::Error)> {
    let mut created = Vec::new();
    for s in staged {
        let target = s.target.clone();
        let new = fs::symlink_metadata(&target).is_err();
        if let Err(e) = s.commit() {
            for path in created {
                let _ = fs::remove_file(path);
            }
            return Err((target, e));
        }
        if new {
            created.push(target);
        }
    }
    Ok(())
}

/// Writes `path` atomically with `write`.
pub fn write_with(
    path: &Path,
    write: impl FnOnce(&mut BufWriter<File>) -> io::Result<()>,
) -> io::Result<()> {
    Staged::new(path, write)?.commit()
}

/// Writes `bytes` to `path` atomically.
pub fn write(path: &Path, bytes: &[u8]) -> io::Result<()> {
    write_with(path, |w| w.write_all(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn writes_replaces_and_leaves_no_temporary_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.bin");
        write(&p, b"one").unwrap();
        write(&p, b"two").unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"two");
        assert_eq!(names(dir.path()), ["f.bin"]);
    }

    #[test]
    fn a_failing_writer_leaves_the_old_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.bin");
        write(&p, b"old").unwrap();
        let err = write_with(&p, |w| {
            w.write_all(b"partial")?;
            Err(io::Error::other("boom"))
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "boom");
        assert_eq!(fs::read(&p).unwrap(), b"old");
        assert_eq!(names(dir.path()), ["f.bin"]);
    }

    #[cfg(unix)]
    #[test]
    fn new_files_get_the_umask_permissions_and_replacements_keep_theirs() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f.bin");
        write(&p, b"x").unwrap();
        // What a plain create gives under this process's umask.
        let q = dir.path().join("plain");
        {
            use std::os::unix::fs::OpenOptionsExt;
            OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o666)
                .open(&q)
                .unwrap();
        }
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&p), mode(&q));
        assert_ne!(mode(&p), 0o600, "not tempfile's 0600");
        fs::set_permissions(&p, fs::Permissions::from_mode(0o640)).unwrap();
        write(&p, b"y").unwrap();
        assert_eq!(mode(&p), 0o640);
    }

    #[test]
    fn staged_files_appear_together_or_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("missing/b");
        let sa = Staged::new(&a, |w| w.write_all(b"a")).unwrap();
        assert!(Staged::new(&b, |w| w.write_all(b"b")).is_err());
        drop(sa);
        assert!(names(dir.path()).is_empty(), "{:?}", names(dir.path()));
        let sa = Staged::new(&a, |w| w.write_all(b"a")).unwrap();
        let sc = Staged::new(&dir.path().join("c"), |w| w.write_all(b"c")).unwrap();
        assert_eq!(names(dir.path()).len(), 2, "two temporary files");
        commit_all(vec![sa, sc]).unwrap();
        assert_eq!(names(dir.path()), ["a", "c"]);
    }

    #[test]
    fn check_writable_names_the_problem() {
        let dir = tempfile::tempdir().unwrap();
        assert!(check_writable(&dir.path().join("ok")).is_ok());
        assert!(names(dir.path()).is_empty());
        let e = check_writable(&dir.path().join("nodir/x")).unwrap_err();
        assert!(e.to_string().contains("does not exist"), "{e}");
        let e = check_writable(dir.path()).unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
    }
}
