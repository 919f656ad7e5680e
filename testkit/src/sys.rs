//! Process limits and resource usage (Linux/Unix, through libc): raising the open-file limit so
//! one process can hold thousands of connections, and this process's CPU time and peak memory.

use std::io;
use std::time::Duration;

/// Raises the soft open-file limit to the hard limit and returns the new soft limit. Every
/// connection is a descriptor: 10,000 concurrent streams need more than the usual 1,024.
pub fn raise_fd_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we pass; no other memory is touched.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit only reads the struct we pass.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(io::Error::last_os_error());
        }
        lim = raised;
    }
    #[allow(clippy::unnecessary_cast)] // rlim_t is u64 on Linux, not on every Unix
    Ok(lim.rlim_cur as u64)
}

/// CPU time used by this process so far and its peak resident memory.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Usage {
    pub user: Duration,
    pub system: Duration,
    pub max_rss_bytes: u64,
}

impl Usage {
    pub fn cpu(&self) -> Duration {
        self.user + self.system
    }
}

fn timeval(tv: libc::timeval) -> Duration {
    Duration::from_secs(tv.tv_sec.max(0) as u64) + Duration::from_micros(tv.tv_usec.max(0) as u64)
}

/// `getrusage(RUSAGE_SELF)`: every thread of this process.
pub fn usage() -> io::Result<Usage> {
    // SAFETY: an all-zero rusage is a valid value of this plain C struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage writes into the struct we pass; no other memory is touched.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Usage {
        user: timeval(ru.ru_utime),
        system: timeval(ru.ru_stime),
        // Linux reports kilobytes.
        max_rss_bytes: (ru.ru_maxrss.max(0) as u64) * 1024,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn limits_and_usage() {
        let n = raise_fd_limit().unwrap();
        assert!(n >= 64, "{n}");
        let before = usage().unwrap();
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let after = usage().unwrap();
        assert!(after.cpu() > before.cpu());
        assert!(after.max_rss_bytes > 1 << 20);
    }
}
