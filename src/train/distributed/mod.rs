//! Data-parallel training: the same step file on R processes, one all-reduce per window.
//!
//! A window of K micro-batches is spread over the R ranks (K % R == 0): global micro-batch
//! `i` goes to rank `i mod R`, so R ranks see the windows one process sees. Each rank runs
//! its micro-steps with the step's *accumulate* specialisation ([`crate::split`]); at the
//! window's end one all-reduce (sum) carries every state that accumulates within a window
//! (by role, from the manifest: accumulators, the weighted normalisation's weight sum, the
//! window sums of BatchNorm statistics and the micro-step counter), the finiteness flag of
//! loss scaling, every rank's failure flag and the losses of the window's micro-steps. Every
//! rank then runs the *apply-only* specialisation ([`apply_only`]) on the reduced values,
//! so the parameters stay identical on every rank (checked by a digest exchange at the
//! start and the end of a run). The only difference to one process is the order of the
//! sum.
//!
//! The collective is a small trait, [`Collective`]: [`SingleProcess`] (the default, every
//! operation the identity) and, behind the cargo feature `mpi`, [`mpi::Mpi`] over the
//! system's MPI (rsmpi). The trait has what the window needs and nothing MPI-specific: an
//! NCCL implementation (all-reduce on device buffers, for GPUs) fits behind it later, with
//! the host-side packing of [`crate::train::Trainer::run_window`] replaced by device
//! buffers.

pub mod apply_only;
#[cfg(feature = "mpi")]
pub mod mpi;
pub(crate) mod window;

pub use apply_only::apply_only;
pub use window::{is_input_error, ReducePlan, ReducedState};

/// A failure of the collective layer itself.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The backend is not in this build or not usable on this machine.
    #[error("{0}")]
    Unavailable(String),
    /// An operation failed (for backends that report errors instead of aborting the job).
    #[error("{op}: {message}")]
    Failed { op: &'static str, message: String },
}

/// The operations data-parallel training needs from a group of processes. Every operation
/// is collective: every rank calls it, in the same order, with buffers of the same length.
///
/// Implementations: [`SingleProcess`] (one rank), [`mpi::Mpi`] (feature `mpi`). The seam is
/// kept narrow on purpose so that an NCCL backend (GPUs) can implement it too.
pub trait Collective {
    /// This process's rank, `0..size()`.
    fn rank(&self) -> usize;
    /// The number of ranks.
    fn size(&self) -> usize;
    /// A short name for messages ("mpi", "single process").
    fn name(&self) -> &str;
    /// Element-wise sum over the ranks, in place: every rank ends with the same sum.
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), CollectiveError>;
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<(), CollectiveError>;
    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), CollectiveError>;
    /// Waits until every rank has called it.
    fn barrier(&self) -> Result<(), CollectiveError>;
}

/// One process: every collective operation is the identity.
#[derive(Clone, Copy, Debug, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn name(&self) -> &str {
        "single process"
    }
    fn all_reduce_sum_f32(&self, _: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn all_reduce_sum_i64(&self, _: &mut [i64]) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn barrier(&self) -> Result<(), CollectiveError> {
        Ok(())
    }
}

/// Each rank's `value`, in rank order, on every rank: a gather done with the one primitive
/// every backend has (a sum where each rank fills only its own slot is exact).
pub fn gather_u64(c: &dyn Collective, value: u64) -> Result<Vec<u64>, CollectiveError> {
    let mut slots = vec![0i64; c.size()];
    slots[c.rank()] = value as i64;
    c.all_reduce_sum_i64(&mut slots)?;
    Ok(slots.into_iter().map(|v| v as u64).collect())
}

/// The ranks for which `flag` is true, on every rank.
pub fn ranks_where(c: &dyn Collective, flag: bool) -> Result<Vec<usize>, CollectiveError> {
    Ok(gather_u64(c, flag as u64)?
        .into_iter()
        .enumerate()
        .filter(|(_, v)| *v != 0)
        .map(|(r, _)| r)
        .collect())
}

/// The collective named by `train --distributed NAME`. `mpi` initialises MPI (once per
/// process; dropping the returned value finalises it): under `mpirun` every rank joins
/// the job, run alone it is a job of one rank.
pub fn open(name: &str) -> Result<Box<dyn Collective>, CollectiveError> {
    match name {
        "mpi" => open_mpi(),
        "none" | "single" => Ok(Box::new(SingleProcess)),
        other => Err(CollectiveError::Unavailable(format!(
            "--distributed {other}: expected mpi"
        ))),
    }
}

#[cfg(feature = "mpi")]
fn open_mpi() -> Result<Box<dyn Collective>, CollectiveError> {
    Ok(Box::new(mpi::Mpi::init()?))
}

#[cfg(not(feature = "mpi"))]
fn open_mpi() -> Result<Box<dyn Collective>, CollectiveError> {
    Err(CollectiveError::Unavailable(
        "--distributed mpi: this onnx-ga was built without MPI; build it with \
         `cargo build --release --features mpi` (needs an MPI installation, e.g. Debian's \
         openmpi-bin and libopenmpi-dev, and libclang-dev for the bindings)"
            .into(),
    ))
}

/// Whether this build has the MPI backend.
pub const HAS_MPI: bool = cfg!(feature = "mpi");

/// A collective shared by several owners (a host keeps one to agree with its peers while
/// its [`crate::train::Trainer`] holds another).
impl<C: Collective + ?Sized> Collective for std::rc::Rc<C> {
    fn rank(&self) -> usize {
        (**self).rank()
    }
    fn size(&self) -> usize {
        (**self).size()
    }
    fn name(&self) -> &str {
        (**self).name()
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        (**self).all_reduce_sum_f32(buf)
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<(), CollectiveError> {
        (**self).all_reduce_sum_f64(buf)
    }
    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), CollectiveError> {
        (**self).all_reduce_sum_i64(buf)
    }
    fn barrier(&self) -> Result<(), CollectiveError> {
        (**self).barrier()
    }
}
