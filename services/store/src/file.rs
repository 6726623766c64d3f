//! Opening a store's redb file so that a process killed while creating it cannot leave a file
//! no later start can open.

use std::fs::{self, File};
use std::io;
use std::path::{Path, PathBuf};

/// Opens the redb file at `path`, creating it when missing. Its directory must exist.
///
/// redb writes a new file's header in place, so a process killed while creating one (a
/// service stopped with SIGKILL moments after it started) leaves a file redb refuses for
/// good ("Not a redb database"), and the service, which would otherwise restart cleanly,
/// fails on every start. A new file is therefore made whole under a temporary name beside
/// `path`, synced, and linked into place in one step: `path` either does not exist or is a
/// whole redb file. A link rather than a rename, so that a file another process made
/// meanwhile is kept, never replaced. An existing file is opened as it is, never recreated:
/// a damaged one is the operator's to look at.
pub fn open_redb(path: &Path) -> Result<redb::Database, redb::DatabaseError> {
    match fs::symlink_metadata(path) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => create_whole(path)?,
        Err(e) => return Err(e.into()),
    }
    redb::Database::create(path)
}

/// The temporary name a new file of `path` is made under: hidden, beside it.
fn fresh_name(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.new"))
}

fn create_whole(path: &Path) -> Result<(), redb::DatabaseError> {
    let fresh = fresh_name(path);
    // A leftover of an earlier start killed while making it: never linked, so nobody's data.
    match fs::remove_file(&fresh) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    redb::Database::create(&fresh)?.close()?;
    File::open(&fresh)?.sync_all()?;
    match fs::hard_link(&fresh, path) {
        Ok(()) => {}
        // Another process made it meanwhile: theirs stands.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e.into()),
    }
    fs::remove_file(&fresh)?;
    // The link itself must survive a crash, or the next start makes another (empty) file.
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use redb::ReadableDatabase;

    use super::*;

    const TABLE: redb::TableDefinition<&str, u64> = redb::TableDefinition::new("t");

    #[test]
    fn a_new_file_is_made_whole_and_an_existing_one_opened_with_its_records() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        let db = open_redb(&path).unwrap();
        let txn = db.begin_write().unwrap();
        txn.open_table(TABLE).unwrap().insert("k", 7).unwrap();
        txn.commit().unwrap();
        drop(db);
        assert!(!fresh_name(&path).exists());
        let db = open_redb(&path).unwrap();
        let read = db.begin_read().unwrap();
        let value = read.open_table(TABLE).unwrap().get("k").unwrap().unwrap();
        assert_eq!(value.value(), 7);
    }

    #[test]
    fn a_half_made_file_left_by_a_killed_start_does_not_stop_the_next() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        // What a kill while redb wrote the header leaves under the temporary name.
        fs::write(fresh_name(&path), b"redb\x1a\x0a\xa9\x0d").unwrap();
        let db = open_redb(&path).unwrap();
        assert!(db.begin_write().is_ok());
        assert!(!fresh_name(&path).exists());
    }

    #[test]
    fn an_existing_file_that_is_not_redb_is_refused_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("state.redb");
        fs::write(
            &path,
            b"someone's bytes, not a redb file at all, long enough to read",
        )
        .unwrap();
        assert!(open_redb(&path).is_err());
        assert_eq!(
            fs::read(&path).unwrap(),
            b"someone's bytes, not a redb file at all, long enough to read"
        );
    }
}
