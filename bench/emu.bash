# bench/emu.bash - emulated machines for the ring benchmarks (sourced by bench/ring.sh and
# bench/experts.sh, not run on its own).
#
# An emulated machine i is a cgroup v1 cpu group kvr-bench-i holding F of one core (--quota),
# a network namespace kvr-bi with address 10.78.0.(i+1) joined by a veth pair to a Linux
# bridge kvr-br (10.78.0.254) in this namespace (--netns), and with --pin a fixed set of
# CPUs. Everything made here is removed by emu_cleanup (the callers trap EXIT with it).
#
#   emu_setup N QUOTA NETNS PIN THREADS [PERIOD_US]
#                                         make N machines (QUOTA "" = no cgroup, NETNS and
#                                         PIN 0 or 1, PERIOD_US the CFS period, "" = 2 ms or
#                                         what a 1 ms quota needs); sets EMU_HOSTS
#                                         "h0,h1,..." and EMU_BRIDGE_HOST (the address the
#                                         machines reach this namespace on)
#   emu_host I                            machine I's address
#   emu_spawn I LOG CMD...                run CMD on machine I in the background (stdout and
#                                         stderr to LOG), move it into I's cgroup; its pid
#                                         is in EMU_PID and appended to PIDS
#   emu_stop PID...                       SIGTERM the processes, wait for them
#   emu_wait_log PATTERN LOG...           wait (60 s at most) until every LOG has PATTERN
#   emu_wait_port I PORT                  wait (60 s at most) until machine I listens on PORT
#   emu_cleanup                           kill PIDS, remove cgroups, namespaces and links
#   cpu_ns PID                            CPU time (ns) every thread of PID has run
#   cg_stat I                             machine I's cgroup cpu.stat: "nr_periods
#                                         nr_throttled throttled_time_ns" (0 0 0 without one)
#   cpu_stat                              per CPU "cpuN busy idle softirq steal" in ticks
#                                         from /proc/stat (busy: user, nice, system, irq,
#                                         softirq; idle: idle and iowait)
#   median                                the median of the numbers on stdin
#
# Needs root and iproute2 for --quota and --netns. Nothing listens outside 127.0.0.1 or the
# namespaces and the bridge made here.

PIDS=()
EMU_N=0 EMU_QUOTA="" EMU_NETNS=0 EMU_PIN=0 EMU_THREADS=1 EMU_MADE_NETNS=0 EMU_MADE_CG=0
EMU_HOSTS="127.0.0.1" EMU_BRIDGE_HOST=127.0.0.1

emu_setup() { # N QUOTA NETNS PIN THREADS [PERIOD_US]
    EMU_N=$1 EMU_QUOTA=$2 EMU_NETNS=$3 EMU_PIN=$4 EMU_THREADS=$5
    local want_period=${6:-}
    local i cg period
    if [ -n "$EMU_QUOTA" ]; then
        EMU_MADE_CG=1
        for ((i = 0; i < EMU_N; i++)); do
            cg=/sys/fs/cgroup/cpu/kvr-bench-$i
            mkdir -p "$cg"
            # A short period (2 ms) makes the quota a steady half core: with the default
            # 100 ms a machine that is idle most of the time (a drained ring) would burst at
            # full speed. The kernel's smallest quota is 1 ms, so fractions under a half
            # stretch the period. PERIOD_US sets it (to see what the period does).
            period=$(awk -v q="$EMU_QUOTA" -v w="$want_period" \
                'BEGIN { p = w ? w : 2000; if (q * p < 1000) p = int(1000 / q + 0.5); print p }')
            echo "$period" >"$cg/cpu.cfs_period_us"
            awk -v q="$EMU_QUOTA" -v p="$period" 'BEGIN { printf "%d\n", q * p }' >"$cg/cpu.cfs_quota_us"
        done
    fi
    EMU_HOSTS="" EMU_BRIDGE_HOST=127.0.0.1
    if [ "$EMU_NETNS" = 1 ]; then
        EMU_MADE_NETNS=1
        ip link add kvr-br type bridge
        ip addr add 10.78.0.254/24 dev kvr-br
        ip link set kvr-br up
        for ((i = 0; i < EMU_N; i++)); do
            ip netns add "kvr-b$i"
            ip link add "kvr-h$i" type veth peer name "kvr-n$i"
            ip link set "kvr-n$i" netns "kvr-b$i"
            ip link set "kvr-h$i" master kvr-br
            ip link set "kvr-h$i" up
            ip -n "kvr-b$i" addr add "10.78.0.$((i + 1))/24" dev "kvr-n$i"
            ip -n "kvr-b$i" link set "kvr-n$i" up
            ip -n "kvr-b$i" link set lo up
            EMU_HOSTS="$EMU_HOSTS${EMU_HOSTS:+,}10.78.0.$((i + 1))"
        done
        EMU_BRIDGE_HOST=10.78.0.254
    else
        EMU_HOSTS=127.0.0.1
    fi
}

emu_host() { # I
    if [ "$EMU_NETNS" = 1 ]; then echo "10.78.0.$(($1 + 1))"; else echo 127.0.0.1; fi
}

emu_spawn() { # I LOG CMD...
    local i=$1 log=$2
    shift 2
    local cmd=("$@")
    if [ "$EMU_PIN" = 1 ]; then # machine i's THREADS CPUs, from CPU i x THREADS on, wrapping
        local cpus="" k
        for ((k = 0; k < EMU_THREADS; k++)); do
            cpus="$cpus${cpus:+,}$(((i * EMU_THREADS + k) % $(nproc)))"
        done
        cmd=(taskset -c "$cpus" "${cmd[@]}")
    fi
    if [ "$EMU_NETNS" = 1 ]; then cmd=(ip netns exec "kvr-b$i" "${cmd[@]}"); fi
    "${cmd[@]}" >"$log" 2>&1 &
    EMU_PID=$!
    PIDS+=("$EMU_PID")
    # ip netns exec, taskset and env exec their command, so the pid is the process itself,
    # and moving it moves all its threads. It loads its model on its quota too; callers
    # wait for it to listen before they measure anything.
    if [ -n "$EMU_QUOTA" ]; then echo "$EMU_PID" >"/sys/fs/cgroup/cpu/kvr-bench-$i/cgroup.procs"; fi
}

emu_stop() { # PID...
    local p
    for p in "$@"; do kill "$p" 2>/dev/null || true; done
    for p in "$@"; do wait "$p" 2>/dev/null || true; done
}

emu_wait_log() { # PATTERN LOG...
    local pat=$1 f w
    shift
    for f in "$@"; do
        for ((w = 0; w < 600; w++)); do
            grep -q "$pat" "$f" 2>/dev/null && break
            sleep 0.1
        done
        grep -q "$pat" "$f" 2>/dev/null || { echo "emu: no '$pat' in $f:" >&2; tail -5 "$f" >&2; return 1; }
    done
}

emu_wait_port() { # I PORT
    local inns=() w
    [ "$EMU_NETNS" = 0 ] || inns=(ip netns exec "kvr-b$1")
    for ((w = 0; w < 600; w++)); do
        "${inns[@]}" ss -Hltn "sport = :$2" 2>/dev/null | grep -q . && return 0
        sleep 0.1
    done
    echo "emu: nothing listens on port $2 of machine $1" >&2
    return 1
}

emu_cleanup() {
    local p i
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    if [ "$EMU_MADE_CG" = 1 ]; then
        for ((i = 0; i < EMU_N; i++)); do rmdir "/sys/fs/cgroup/cpu/kvr-bench-$i" 2>/dev/null || true; done
    fi
    if [ "$EMU_MADE_NETNS" = 1 ]; then
        for ((i = 0; i < EMU_N; i++)); do
            ip netns del "kvr-b$i" 2>/dev/null || true
            ip link del "kvr-h$i" 2>/dev/null || true
        done
        ip link del kvr-br 2>/dev/null || true
    fi
}

cpu_ns() { cat /proc/"$1"/task/*/schedstat 2>/dev/null | awk '{ t += $1 } END { printf "%.0f\n", t }'; }

cg_stat() { # I
    local f=/sys/fs/cgroup/cpu/kvr-bench-$1/cpu.stat
    if [ -n "$EMU_QUOTA" ] && [ -r "$f" ]; then
        awk '$1 == "nr_periods" { p = $2 } $1 == "nr_throttled" { n = $2 }
             $1 == "throttled_time" { t = $2 } END { print p + 0, n + 0, t + 0 }' "$f"
    else
        echo 0 0 0
    fi
}

cpu_stat() { awk '/^cpu[0-9]/ { print $1, $2 + $3 + $4 + $7 + $8, $5 + $6, $8, $9 }' /proc/stat; }

median() { sort -g | awk '{ a[NR] = $1 } END { print (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2 }'; }
