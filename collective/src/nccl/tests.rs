//! What can be checked without a GPU: device-list validation, and that a machine without a driver
//! or libnccl gets a clear error rather than a panic. The collectives themselves are checked on a
//! GPU by `strata gpu nccl`.

use super::*;

#[test]
fn an_empty_or_repeated_device_list_is_refused_before_touching_cuda() {
    let empty = NcclGroup::new(&[]).unwrap_err();
    assert!(
        matches!(empty, CollectiveError::InvalidDevices(_)),
        "{empty}"
    );
    let twice = NcclGroup::new(&[0, 1, 0]).unwrap_err();
    assert!(
        twice.to_string().contains("device 0 is listed twice"),
        "{twice}"
    );
}

#[test]
fn a_device_beyond_the_count_is_refused() {
    let err = check_devices(&[0, 3], Some(2)).unwrap_err();
    assert!(err.to_string().contains("device 3 does not exist"), "{err}");
    assert!(check_devices(&[1, 0], Some(2)).is_ok());
}

/// On a machine without the NVIDIA driver (this crate's CI) the group fails with an error naming
/// libcuda; with a driver but no libnccl, one naming libnccl. Either way: an error, not a panic.
#[test]
fn without_a_driver_or_libnccl_a_group_is_a_clear_error() {
    // SAFETY: only tries to dlopen the libraries by name.
    let driver = unsafe { cudarc::driver::sys::is_culib_present() };
    let nccl = unsafe { cudarc::nccl::sys::is_culib_present() };
    match NcclGroup::new(&[0]) {
        Err(CollectiveError::LibraryMissing { library, looked }) => {
            let named = if driver { "libnccl" } else { "libcuda" };
            assert!(library.contains(named), "{library}");
            assert!(!looked.is_empty());
        }
        Err(other) => assert!(driver && nccl, "unexpected error: {other}"),
        Ok(comms) => assert!(driver && nccl && comms.len() == 1),
    }
}

#[test]
fn nccl_errors_carry_nccl_s_result_name() {
    let sys = cudarc::nccl::sys::ncclResult_t::ncclInvalidArgument;
    // Without libnccl, ncclGetErrorString cannot be called; the name alone is the message.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        let err = CollectiveError::Nccl {
            call: "ncclAllGather",
            result: format!("{sys:?}"),
        };
        assert_eq!(
            err.to_string(),
            "NCCL ncclAllGather failed: ncclInvalidArgument"
        );
    } else {
        let err = nccl_error("ncclAllGather", &NcclError(sys));
        assert!(err.to_string().contains("ncclInvalidArgument"), "{err}");
    }
}

#[test]
fn handles_can_move_to_rank_threads() {
    fn send<T: Send>() {}
    send::<NcclCommunicator>();
}
