//! [`Collective`] over MPI (rsmpi on the system's MPI library, e.g. Open MPI).
//!
//! rsmpi runs MPI with `MPI_ERRORS_ARE_FATAL`: a failed operation (a peer that died, a
//! broken link) aborts the whole job from inside the library, and `mpirun` reports which
//! rank went away. Failures *we* detect (bad data, a non-finite loss) travel as flags in
//! the window's all-reduce instead, so every rank stops with an error of its own.

use mpi::collective::SystemOperation;
use mpi::environment::Universe;
use mpi::topology::{Communicator, SimpleCommunicator};
use mpi::traits::CommunicatorCollectives;

use super::{Collective, CollectiveError};

pub struct Mpi {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    /// Finalises MPI when dropped (after the world communicator).
    _universe: Universe,
}

impl Mpi {
    /// Initialises MPI for this process. Only the main thread calls MPI (the engines' own
    /// threads never do), hence `Funneled`.
    pub fn init() -> Result<Mpi, CollectiveError> {
        let (universe, _) =
            mpi::initialize_with_threading(mpi::Threading::Funneled).ok_or_else(|| {
                CollectiveError::Unavailable(
                    "MPI is already initialised in this process (one job per process)".into(),
                )
            })?;
        let world = universe.world();
        let rank = usize::try_from(world.rank()).unwrap_or(0);
        let size = usize::try_from(world.size()).unwrap_or(1);
        Ok(Mpi {
            world,
            rank,
            size,
            _universe: universe,
        })
    }

    fn sum<T>(&self, buf: &mut [T]) -> Result<(), CollectiveError>
    where
        T: mpi::datatype::Equivalence + Copy,
        [T]: mpi::datatype::Buffer + mpi::datatype::BufferMut,
    {
        if self.size == 1 || buf.is_empty() {
            return Ok(());
        }
        // rsmpi's safe API has no MPI_IN_PLACE: reduce from a copy.
        let send = buf.to_vec();
        self.world
            .all_reduce_into(&send[..], buf, SystemOperation::sum());
        Ok(())
    }
}

impl Collective for Mpi {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn name(&self) -> &str {
        "mpi"
    }
    fn all_reduce_sum_f32(&self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.sum(buf)
    }
    fn all_reduce_sum_f64(&self, buf: &mut [f64]) -> Result<(), CollectiveError> {
        self.sum(buf)
    }
    fn all_reduce_sum_i64(&self, buf: &mut [i64]) -> Result<(), CollectiveError> {
        self.sum(buf)
    }
    fn barrier(&self) -> Result<(), CollectiveError> {
        self.world.barrier();
        Ok(())
    }
}
