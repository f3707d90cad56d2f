//! The machine this process computes on and its share of it (`scheduler::HostShare`):
//! ring members on one machine are known as such by the same boot id, and the scheduler
//! counts their cores once. Read fresh for every profile (never cached: a reboot changes
//! the id, a cgroup its quota).

use scheduler::HostShare;

/// This process computing with `threads` threads.
pub fn host_share(threads: usize) -> HostShare {
    let read = |p: &str| std::fs::read_to_string(p).ok();
    host_share_from(threads, read)
}

/// [`host_share`] over a file reader, for tests.
pub fn host_share_from(threads: usize, read: impl Fn(&str) -> Option<String>) -> HostShare {
    // The boot id is the kernel's: containers and network namespaces share it, so members
    // emulated as devices on one machine are known to share it. The machine id (systemd)
    // stands in where there is no boot id; both are random, so neither says anything else
    // about the machine.
    let id = ["/proc/sys/kernel/random/boot_id", "/etc/machine-id"].iter().find_map(|p| read(p).map(|t| t.trim().to_string()).filter(|t| !t.is_empty())).unwrap_or_default();
    let cores = read("/sys/devices/system/cpu/online").and_then(|t| cpu_list_len(&t)).map(|n| n as f64).unwrap_or_else(|| std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64));
    let allowed = read("/proc/self/status").and_then(|s| s.lines().find_map(|l| l.strip_prefix("Cpus_allowed_list:")).and_then(cpu_list_len)).map_or(cores, |n| n as f64);
    let cgroup = read("/proc/self/cgroup").unwrap_or_default();
    let quota = cpu_quota(&cgroup, &read).map_or(allowed, |q| q.min(allowed)).min(cores);
    // A memory cgroup's limit is this process's alone; without one the RAM it reports is
    // the machine's, which co-located members share (`scheduler::share_host_memory`).
    let own_memory = engine::residency::memory_budget_from(&cgroup, &read).is_some_and(|b| b.source != engine::residency::MemorySource::MemAvailable);
    HostShare { id, cores, threads, quota, own_memory }
}

/// CPUs in a kernel CPU list (`0-3,8,10-11`).
fn cpu_list_len(list: &str) -> Option<usize> {
    let mut n = 0;
    for part in list.trim().split(',').filter(|p| !p.is_empty()) {
        n += match part.split_once('-') {
            Some((a, b)) => b.trim().parse::<usize>().ok()?.checked_sub(a.trim().parse::<usize>().ok()?)? + 1,
            None => part.trim().parse::<usize>().map(|_| 1).ok()?,
        };
    }
    (n > 0).then_some(n)
}

/// The cores this process's cgroup may use (a CFS quota, v1 or v2); `None`: no quota.
fn cpu_quota(proc_self_cgroup: &str, read: &impl Fn(&str) -> Option<String>) -> Option<f64> {
    for line in proc_self_cgroup.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        let path = path.trim_end_matches('/');
        // As for memory (engine::residency): the process's own path first, then the root
        // of the hierarchy, which is its own cgroup inside a container.
        let at = |dir: &str, file: &str| read(&format!("{dir}{path}/{file}")).or_else(|| read(&format!("{dir}/{file}")));
        if controllers.split(',').any(|c| c == "cpu") {
            for dir in ["/sys/fs/cgroup/cpu", "/sys/fs/cgroup/cpu,cpuacct"] {
                let quota = at(dir, "cpu.cfs_quota_us").and_then(|t| t.trim().parse::<f64>().ok());
                let period = at(dir, "cpu.cfs_period_us").and_then(|t| t.trim().parse::<f64>().ok());
                if let (Some(q), Some(p)) = (quota, period) {
                    return (q > 0.0 && p > 0.0).then(|| q / p);
                }
            }
        } else if controllers.is_empty() {
            let max = at("/sys/fs/cgroup", "cpu.max")?;
            let mut it = max.split_whitespace();
            let (q, p) = (it.next()?, it.next().and_then(|p| p.parse::<f64>().ok())?);
            return q.parse::<f64>().ok().filter(|&q| q > 0.0 && p > 0.0).map(|q| q / p);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(entries: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |p| entries.iter().find(|(k, _)| *k == p).map(|(_, v)| v.to_string())
    }

    #[test]
    fn a_member_in_cgroups_shares_the_machine_with_its_quota_and_keeps_its_memory() {
        let share = host_share_from(
            1,
            files(&[
                ("/proc/sys/kernel/random/boot_id", "3f1c0d6e-1b7a-4c4e-9d59-1c7c3a3bb1a2\n"),
                ("/sys/devices/system/cpu/online", "0-1\n"),
                ("/proc/self/status", "Name:\thearth\nCpus_allowed_list:\t0-1\n"),
                ("/proc/self/cgroup", "5:cpu,cpuacct:/hearth-device-w1\n4:memory:/hearth-device-w1\n0::/\n"),
                ("/sys/fs/cgroup/memory/hearth-device-w1/memory.limit_in_bytes", "536870912\n"),
                ("/sys/fs/cgroup/cpu/hearth-device-w1/cpu.cfs_quota_us", "6600\n"),
                ("/sys/fs/cgroup/cpu/hearth-device-w1/cpu.cfs_period_us", "10000\n"),
            ]),
        );
        assert_eq!(share.id, "3f1c0d6e-1b7a-4c4e-9d59-1c7c3a3bb1a2");
        assert_eq!((share.cores, share.threads), (2.0, 1));
        assert!((share.quota - 0.66).abs() < 1e-9, "{share:?}");
        assert!(share.own_memory, "a memory cgroup's limit is the member's own");
    }

    #[test]
    fn without_a_quota_a_member_may_use_the_cores_it_is_allowed_and_v2_quotas_are_read() {
        let unlimited = host_share_from(
            2,
            files(&[
                ("/sys/devices/system/cpu/online", "0-7\n"),
                ("/proc/self/status", "Cpus_allowed_list:\t0-3,6\n"),
                ("/proc/self/cgroup", "5:cpu,cpuacct:/\n0::/\n"),
                ("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "-1\n"),
                ("/sys/fs/cgroup/cpu/cpu.cfs_period_us", "100000\n"),
                ("/etc/machine-id", "abc\n"),
            ]),
        );
        assert_eq!((unlimited.id.as_str(), unlimited.cores, unlimited.quota), ("abc", 8.0, 5.0));
        assert!(!unlimited.own_memory, "without a limit the RAM is the machine's");
        let v2 = host_share_from(2, files(&[("/sys/devices/system/cpu/online", "0-3\n"), ("/proc/self/cgroup", "0::/user.slice/x\n"), ("/sys/fs/cgroup/user.slice/x/cpu.max", "150000 100000\n")]));
        assert_eq!((v2.id.as_str(), v2.cores, v2.quota), ("", 4.0, 1.5));
        let v2_max = host_share_from(2, files(&[("/sys/devices/system/cpu/online", "0-3\n"), ("/proc/self/cgroup", "0::/\n"), ("/sys/fs/cgroup/cpu.max", "max 100000\n")]));
        assert_eq!(v2_max.quota, 4.0);
    }

    #[test]
    fn cpu_lists_are_counted_and_nonsense_is_no_count() {
        assert_eq!(cpu_list_len("0-3,8,10-11\n"), Some(7));
        assert_eq!(cpu_list_len("0"), Some(1));
        assert_eq!(cpu_list_len(""), None);
        assert_eq!(cpu_list_len("3-1"), None);
        assert_eq!(cpu_list_len("x"), None);
    }
}
