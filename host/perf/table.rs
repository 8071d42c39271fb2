//! nccl-tests output format: message sizes, element counts, bandwidth factors and the result table.
//!
//! Conventions follow nccl-tests 2.19 (`src/common.cu`, `src/*.cu`): `algbw = S / t` in GB/s with
//! 1 GB = 1e9 bytes, `busbw = algbw × factor` ([`bus_factor`]); `S` and the printed size are the
//! larger of the per-rank send and receive buffers ([`data_bytes`]); the count column is the
//! per-rank element count the collective is called with ([`count_for`]).

use oxccl_gpu::abi::{DataType, Func, RedOp};

/// nccl-tests' bus-bandwidth factor for `func` over `nranks` ranks: AllReduce `2(n−1)/n`,
/// AllGather and ReduceScatter `(n−1)/n`, Broadcast and Reduce `1`. `0.0` when `nranks == 0`.
pub fn bus_factor(func: Func, nranks: usize) -> f64 {
    if nranks == 0 {
        return 0.0;
    }
    let n = nranks as f64;
    match func {
        Func::AllReduce => 2.0 * (n - 1.0) / n,
        Func::AllGather | Func::ReduceScatter => (n - 1.0) / n,
        Func::Broadcast | Func::Reduce => 1.0,
    }
}

/// The message sizes in bytes of a sweep, like nccl-tests' `-b min -e max -f factor -i step`:
/// from `min_bytes` up to and including `max_bytes`, adding `step_bytes` each time when it is
/// `Some` (nccl-tests `-i`), else multiplying by `factor` (`-f`). A step of 0 or a factor ≤ 1
/// would never advance, so it yields only `min_bytes`; a geometric sweep from 0 yields 0 and then
/// continues from 1. Empty when `min_bytes > max_bytes`.
pub fn sizes(min_bytes: u64, max_bytes: u64, factor: u64, step_bytes: Option<u64>) -> Vec<u64> {
    let mut out = Vec::new();
    let mut size = min_bytes;
    while size <= max_bytes {
        out.push(size);
        let next = match step_bytes {
            Some(step) if step > 0 => size.checked_add(step),
            Some(_) => None,
            None if factor <= 1 => None,
            None if size == 0 => Some(1),
            None => size.checked_mul(factor),
        };
        match next {
            Some(n) => size = n,
            None => break,
        }
    }
    out
}

/// Parses a byte size as nccl-tests does for `-b`, `-e` and `-i`: a decimal integer with an optional
/// binary suffix `K`, `M`, `G` or `T` (1024-based, case-insensitive), optionally followed by `B` or
/// `iB` (`"8"`, `"1K"`, `"64KiB"`, `"1M"`, `"1G"`, `"512B"`). The error names the rejected value.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (num, suffix) = t.split_at(digits);
    if num.is_empty() {
        return Err(format!(
            "invalid size {s:?}: expected a number with an optional K/M/G/T suffix"
        ));
    }
    let value: u64 = num.parse().map_err(|e| format!("invalid size {s:?}: {e}"))?;
    let lower = suffix.to_ascii_lowercase();
    let unit = lower
        .strip_suffix("ib")
        .or_else(|| lower.strip_suffix('b'))
        .unwrap_or(&lower);
    let shift = match unit {
        "" if lower != "ib" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => {
            return Err(format!(
                "invalid size {s:?}: unknown suffix {suffix:?} (use K, M, G or T, 1024-based)"
            ));
        }
    };
    value
        .checked_mul(1u64 << shift)
        .ok_or_else(|| format!("invalid size {s:?}: too large for 64 bits"))
}

/// The per-rank element count nccl-tests calls `func` with for a sweep size of `bytes` (its
/// `paramcount`): `bytes / dtype.size()` for AllReduce, Broadcast and Reduce; for AllGather (the
/// send count) and ReduceScatter (the receive count) `bytes / dtype.size() / nranks`, rounded down
/// to a multiple of 16 bytes' worth of elements. `0` when `nranks == 0`.
pub fn count_for(func: Func, bytes: u64, dtype: DataType, nranks: usize) -> usize {
    let size = dtype.size() as u64;
    let count = bytes / size;
    let per_rank = match func {
        Func::AllReduce | Func::Broadcast | Func::Reduce => count,
        Func::AllGather | Func::ReduceScatter if nranks == 0 => 0,
        Func::AllGather | Func::ReduceScatter => {
            let align = (16 / size).max(1);
            (count / nranks as u64) / align * align
        }
    };
    usize::try_from(per_rank).unwrap_or(usize::MAX)
}

/// The bytes `S` that `algbw` divides by time, which nccl-tests also prints as the size: the larger
/// of a rank's send and receive buffers, for `count` elements per rank as [`count_for`] returns —
/// `count × size` for AllReduce, Broadcast and Reduce, `count × size × nranks` for AllGather and
/// ReduceScatter.
pub fn data_bytes(func: Func, count: usize, dtype: DataType, nranks: usize) -> u64 {
    let b = count as u64 * dtype.size() as u64;
    match func {
        Func::AllReduce | Func::Broadcast | Func::Reduce => b,
        Func::AllGather | Func::ReduceScatter => b * nranks as u64,
    }
}

/// Algorithm bandwidth in GB/s (1 GB = 1e9 bytes) for `bytes` ([`data_bytes`]) moved in `time_us`
/// microseconds; `0.0` for a non-positive time.
pub fn algbw(bytes: u64, time_us: f64) -> f64 {
    if time_us > 0.0 {
        bytes as f64 / 1.0e3 / time_us
    } else {
        0.0
    }
}

/// One direction's measurement (out-of-place or in-place) of a table row.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Measure {
    /// Average time of one operation, in microseconds.
    pub time_us: f64,
    /// Algorithm bandwidth, GB/s (1e9 bytes per second).
    pub algbw: f64,
    /// Bus bandwidth, GB/s: `algbw × bus_factor`.
    pub busbw: f64,
    /// Mismatching elements summed over ranks, or `None` when not checked (printed `N/A`).
    pub wrong: Option<u64>,
}

impl Measure {
    /// A measurement of `func` on `nranks` ranks moving `bytes` ([`data_bytes`]) in `time_us`
    /// microseconds; computes `algbw` and `busbw`.
    pub fn new(func: Func, nranks: usize, bytes: u64, time_us: f64, wrong: Option<u64>) -> Self {
        Measure::with_factor(bus_factor(func, nranks), bytes, time_us, wrong)
    }

    /// A measurement moving `bytes` (nccl-tests' S) in `time_us` microseconds, whose busbw is
    /// its algbw times `factor` (the operation's bus-bandwidth factor).
    pub fn with_factor(factor: f64, bytes: u64, time_us: f64, wrong: Option<u64>) -> Self {
        let algbw = algbw(bytes, time_us);
        Measure {
            time_us,
            algbw,
            busbw: algbw * factor,
            wrong,
        }
    }
}

/// A reference (NCCL) timing for the comparison columns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RefTiming {
    /// Average time of one operation, in microseconds.
    pub time_us: f64,
    /// Bus bandwidth, GB/s.
    pub busbw: f64,
}

/// NCCL's results for the same row, printed in the comparison columns.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NcclCols {
    /// NCCL out-of-place.
    pub out_of_place: RefTiming,
    /// NCCL in-place; `None` where the operation has no in-place form (printed `N/A`).
    pub in_place: Option<RefTiming>,
}

/// One line of the result table (one message size).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Row {
    /// Printed size in bytes ([`data_bytes`]: the larger per-rank buffer, not the sweep size).
    pub bytes: u64,
    /// Per-rank element count the collective is called with ([`count_for`]).
    pub count: usize,
    /// Element type (printed by its nccl-tests name, e.g. `float`).
    pub dtype: DataType,
    /// Reduction operator, `None` for collectives without one (printed `none`).
    pub redop: Option<RedOp>,
    /// Root rank, `-1` for rootless collectives.
    pub root: i32,
    /// Out-of-place result (`sendbuff != recvbuff`).
    pub out_of_place: Measure,
    /// In-place result; `None` where the operation has no in-place form (AlltoAll: every
    /// in-place column printed `N/A`).
    pub in_place: Option<Measure>,
    /// NCCL's results for comparison; when `Some` the row gets the comparison columns.
    pub nccl: Option<NcclCols>,
    /// What oxccl planned for this size (algorithm, protocol, channels), when known: listed by
    /// [`choices_line`] under the table.
    pub choice: Option<crate::comm::Choice>,
}

impl Row {
    /// oxccl out-of-place busbw over NCCL out-of-place busbw, `None` without a positive NCCL busbw.
    pub fn ratio(&self) -> Option<f64> {
        let n = self.nccl?.out_of_place.busbw;
        (n > 0.0).then(|| self.out_of_place.busbw / n)
    }
}

/// The table header (three lines, each ending in `\n`), nccl-tests' layout; with `compare`, also the
/// NCCL columns (time and busbw, out-of-place and in-place) and the busbw ratio.
pub fn header(compare: bool) -> String {
    header_for(compare.then_some("nccl"))
}

/// [`header`] with reference columns named `reference` ("nccl"; `None`: no reference).
pub fn header_for(reference: Option<&str>) -> String {
    let compare = reference.is_some();
    let label = reference.unwrap_or("nccl");
    let lead = |a: &str, b: &str| format!("# {a:>10}  {b:>12}  {:>8}  {:>6}  {:>6}", "", "", "");
    let mut l1 = format!("{}{:11}out-of-place{:23}in-place{:10}", lead("", ""), "", "", "");
    let mut l2 = format!(
        "# {:>10}  {:>12}  {:>8}  {:>6}  {:>6}",
        "size", "count", "type", "redop", "root"
    );
    let mut l3 = lead("(B)", "(elements)");
    for _ in 0..2 {
        l2 += &format!("  {:>7}  {:>6}  {:>6} {:>6}", "time", "algbw", "busbw", "#wrong");
        l3 += &format!("  {:>7}  {:>6}  {:>6} {:>6}", "(us)", "(GB/s)", "(GB/s)", "");
    }
    if compare {
        l1 += &format!("{:>17}{:>17}{:>8}", format!("{label} out-of-place"), format!("{label} in-place"), "");
        for _ in 0..2 {
            l2 += &format!("  {:>7}  {:>6}", "time", "busbw");
            l3 += &format!("  {:>7}  {:>6}", "(us)", "(GB/s)");
        }
        l2 += &format!("  {:>6}", "ratio");
        l3 += &format!("  {:>6}", "(oop)");
    }
    [l1, l2, l3]
        .iter()
        .map(|l| format!("{}\n", l.trim_end()))
        .collect()
}

/// A time in microseconds as nccl-tests prints it, 7 wide: no decimals from 10000 µs, one from
/// 100 µs, else two.
pub fn time_str(time_us: f64) -> String {
    if time_us >= 10000.0 {
        format!("{time_us:7.0}")
    } else if time_us >= 100.0 {
        format!("{time_us:7.1}")
    } else {
        format!("{time_us:7.2}")
    }
}

/// One table line (no trailing `\n`) in nccl-tests' layout, followed by the comparison columns
/// when `row.nccl` is `Some` (ratio `N/A` when NCCL's busbw is not positive).
pub fn format_row(row: &Row) -> String {
    let redop = row.redop.map_or("none", RedOp::name);
    let mut s = format!(
        "{:>12}  {:>12}  {:>8}  {:>6}  {:>6}",
        row.bytes,
        row.count,
        row.dtype.name(),
        redop,
        row.root
    );
    for m in [Some(&row.out_of_place), row.in_place.as_ref()] {
        match m {
            Some(m) => {
                let wrong = m.wrong.map_or_else(|| "N/A".to_string(), |w| fmt_g(w as f64));
                s += &format!(
                    "  {:>7}  {:>6.2}  {:>6.2}  {:>5}",
                    time_str(m.time_us),
                    m.algbw,
                    m.busbw,
                    wrong
                );
            }
            None => s += &format!("  {:>7}  {:>6}  {:>6}  {:>5}", "N/A", "N/A", "N/A", "N/A"),
        }
    }
    if let Some(n) = &row.nccl {
        for t in [Some(&n.out_of_place), n.in_place.as_ref()] {
            match t {
                Some(t) => s += &format!("  {:>7}  {:>6.2}", time_str(t.time_us), t.busbw),
                None => s += &format!("  {:>7}  {:>6}", "N/A", "N/A"),
            }
        }
        match row.ratio() {
            Some(r) => s += &format!("  {r:>6.2}"),
            None => s += &format!("  {:>6}", "N/A"),
        }
    }
    s
}

/// The busbw of `row`'s measurements: out-of-place, then in-place where it ran.
fn busbws(row: &Row) -> impl Iterator<Item = f64> + '_ {
    std::iter::once(row.out_of_place.busbw).chain(row.in_place.map(|m| m.busbw))
}

/// Mean of out-of-place and in-place busbw over `rows` (nccl-tests' "Avg bus bandwidth"), GB/s;
/// in-place runs that do not exist are left out; `0.0` for no rows.
pub fn avg_busbw(rows: &[Row]) -> f64 {
    mean(rows.iter().flat_map(busbws))
}

/// Total wrong elements over all rows, out-of-place and in-place (unchecked measurements count 0).
pub fn total_wrong(rows: &[Row]) -> u64 {
    rows.iter()
        .map(|r| r.out_of_place.wrong.unwrap_or(0) + r.in_place.and_then(|m| m.wrong).unwrap_or(0))
        .sum()
}

/// The footer lines (each ending in `\n`): `# Out of bounds values : N OK|FAILED` and
/// `# Avg bus bandwidth    : X` (mean busbw, GB/s, printed like C's `%g`); when some row has NCCL
/// columns, also NCCL's mean busbw over those rows and the ratio of oxccl's mean busbw to NCCL's
/// over the same rows.
pub fn footer(rows: &[Row]) -> String {
    footer_for(rows, "NCCL")
}

/// [`footer`] with the reference named `reference` ("NCCL").
pub fn footer_for(rows: &[Row], reference: &str) -> String {
    let wrong = total_wrong(rows);
    let mut s = format!(
        "# Out of bounds values : {} {}\n",
        wrong,
        if wrong > 0 { "FAILED" } else { "OK" }
    );
    s += &format!("# Avg bus bandwidth    : {}\n", fmt_g(avg_busbw(rows)));
    let cmp: Vec<&Row> = rows.iter().filter(|r| r.nccl.is_some()).collect();
    if !cmp.is_empty() {
        let nccl = mean(
            cmp.iter()
                .filter_map(|r| r.nccl)
                .flat_map(|n| std::iter::once(n.out_of_place.busbw).chain(n.in_place.map(|t| t.busbw))),
        );
        let ours = mean(cmp.iter().flat_map(|r| busbws(r)));
        s += &format!("# Avg {:<17}: {}\n", format!("{reference} bandwidth"), fmt_g(nccl));
        if nccl > 0.0 {
            s += &format!("# Avg busbw ratio      : {:.2}\n", ours / nccl);
        }
    }
    s
}

/// `# oxccl choice : <first>-<last> B algo/proto/Nch, ...` — the plan oxccl made per size, runs of
/// equal choices merged (`None` when no row records one, e.g. a pure NCCL run).
pub fn choices_line(rows: &[Row]) -> Option<String> {
    let mut runs: Vec<(u64, u64, String)> = Vec::new();
    for r in rows {
        let Some(c) = r.choice else { continue };
        let what = format!("{}/{}/{}ch", c.algo.name(), c.proto.name(), c.nchannels);
        match runs.last_mut() {
            Some((_, last, w)) if *w == what => *last = r.bytes,
            _ => runs.push((r.bytes, r.bytes, what)),
        }
    }
    if runs.is_empty() {
        return None;
    }
    let parts: Vec<String> = runs
        .iter()
        .map(|(a, b, w)| {
            if a == b {
                format!("{a} B {w}")
            } else {
                format!("{a}-{b} B {w}")
            }
        })
        .collect();
    Some(format!("# oxccl choice         : {}\n", parts.join(", ")))
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { 0.0 } else { sum / n as f64 }
}

/// `x` formatted like C's `printf("%g")`: 6 significant digits, trailing zeros removed, exponent
/// form (`1.5e+07`) when the decimal exponent is below -4 or at least 6.
pub fn fmt_g(x: f64) -> String {
    if x == 0.0 {
        return if x.is_sign_negative() { "-0" } else { "0" }.to_string();
    }
    if !x.is_finite() {
        return if x.is_nan() {
            "nan"
        } else if x > 0.0 {
            "inf"
        } else {
            "-inf"
        }
        .to_string();
    }
    let e = format!("{x:.5e}");
    let (mant, exp) = e.split_once('e').unwrap_or((&e, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let strip = |m: &str| -> String {
        if m.contains('.') {
            m.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            m.to_string()
        }
    };
    if !(-4..6).contains(&exp) {
        format!(
            "{}e{}{:02}",
            strip(mant),
            if exp < 0 { '-' } else { '+' },
            exp.unsigned_abs()
        )
    } else {
        strip(&format!("{:.*}", (5 - exp) as usize, x))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    13.61    0.00    0.00      0    13.22    0.00    0.00      0
";

    fn row(bytes: u64, oop_us: f64, ip_us: f64, n: usize) -> Row {
        let count = count_for(Func::AllReduce, bytes, DataType::F32, n);
        let b = data_bytes(Func::AllReduce, count, DataType::F32, n);
        Row {
            bytes: b,
            count,
            dtype: DataType::F32,
            redop: Some(RedOp::Sum),
            root: -1,
            out_of_place: Measure::new(Func::AllReduce, n, b, oop_us, Some(0)),
            in_place: Some(Measure::new(Func::AllReduce, n, b, ip_us, Some(0))),
            nccl: None,
            choice: None,
        }
    }

    #[test]
    fn choices_merge_runs_of_equal_plans() {
        use crate::comm::Choice;
        use oxccl_gpu::abi::{Algo, Proto};
        let plan = |proto, nch| Choice {
            func: Func::AllReduce,
            algo: Algo::Ring,
            proto,
            nchannels: nch,
            chunk_elems: 1,
            slice_elems: 1,
        };
        let mut rows = vec![
            row(8, 10.0, 10.0, 2),
            row(64, 10.0, 10.0, 2),
            row(512, 10.0, 10.0, 2),
        ];
        assert_eq!(choices_line(&rows), None);
        rows[0].choice = Some(plan(Proto::Ll, 1));
        rows[1].choice = Some(plan(Proto::Ll, 1));
        rows[2].choice = Some(plan(Proto::Ll128, 4));
        assert_eq!(
            choices_line(&rows).unwrap(),
            "# oxccl choice         : 8-64 B ring/LL/1ch, 512 B ring/LL128/4ch\n"
        );
    }

    #[test]
    fn bus_factors() {
        assert_eq!(bus_factor(Func::AllReduce, 2), 1.0);
        assert_eq!(bus_factor(Func::AllReduce, 4), 1.5);
        assert_eq!(bus_factor(Func::AllReduce, 8), 1.75);
        assert_eq!(bus_factor(Func::AllGather, 2), 0.5);
        assert_eq!(bus_factor(Func::AllGather, 4), 0.75);
        assert_eq!(bus_factor(Func::ReduceScatter, 8), 0.875);
        for n in [2, 4, 8] {
            assert_eq!(bus_factor(Func::Broadcast, n), 1.0);
            assert_eq!(bus_factor(Func::Reduce, n), 1.0);
        }
        assert_eq!(bus_factor(Func::AllReduce, 1), 0.0);
        assert_eq!(bus_factor(Func::AllReduce, 0), 0.0);
    }

    #[test]
    fn size_sweeps() {
        let s = sizes(8, 1 << 30, 4, None);
        assert_eq!(s.len(), 14);
        assert_eq!(s[0], 8);
        assert_eq!(s[1], 32);
        assert_eq!(*s.last().unwrap(), 1 << 29);
        assert_eq!(sizes(8, 128, 2, None), vec![8, 16, 32, 64, 128]);
        assert_eq!(
            sizes(1 << 20, 4 << 20, 2, Some(1 << 20)),
            vec![1 << 20, 2 << 20, 3 << 20, 4 << 20]
        );
        assert_eq!(sizes(8, 8, 2, None), vec![8]);
        assert_eq!(sizes(16, 8, 2, None), Vec::<u64>::new());
        assert_eq!(sizes(8, 1000, 1, None), vec![8]);
        assert_eq!(sizes(8, 1000, 2, Some(0)), vec![8]);
        assert_eq!(sizes(0, 4, 2, None), vec![0, 1, 2, 4]);
        assert_eq!(sizes(1 << 62, u64::MAX, 4, None), vec![1 << 62]); // no overflow
    }

    #[test]
    fn parse_sizes() {
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("1k"), Ok(1024));
        assert_eq!(parse_size("64KiB"), Ok(64 << 10));
        assert_eq!(parse_size("64KB"), Ok(64 << 10));
        assert_eq!(parse_size("512B"), Ok(512));
        assert_eq!(parse_size("1M"), Ok(1 << 20));
        assert_eq!(parse_size(" 16M "), Ok(16 << 20));
        assert_eq!(parse_size("1G"), Ok(1 << 30));
        assert_eq!(parse_size("2T"), Ok(2 << 40));
        for bad in [
            "",
            "K",
            "1X",
            "1.5M",
            "-1",
            "1iB",
            "99999999999999999999",
            "20000000000G",
        ] {
            let err = parse_size(bad).unwrap_err();
            assert!(err.contains(&format!("{bad:?}")), "{err}");
        }
        assert!(parse_size("1Q").unwrap_err().contains("\"Q\""));
    }

    #[test]
    fn counts_follow_nccl_tests() {
        assert_eq!(count_for(Func::AllReduce, 8, DataType::F32, 8), 2);
        assert_eq!(count_for(Func::AllReduce, 100, DataType::F32, 8), 25);
        assert_eq!(count_for(Func::Broadcast, 1 << 20, DataType::F16, 8), 1 << 19);
        // 1 MiB of floats over 3 ranks: 262144 / 3 = 87381 → multiple of 4 elements.
        assert_eq!(count_for(Func::AllGather, 1 << 20, DataType::F32, 3), 87380);
        assert_eq!(count_for(Func::ReduceScatter, 1 << 20, DataType::I8, 3), 349520);
        assert_eq!(count_for(Func::ReduceScatter, 1 << 20, DataType::F64, 3), 43690);
        assert_eq!(count_for(Func::AllGather, 64, DataType::F32, 8), 0);
        assert_eq!(
            data_bytes(Func::AllGather, 87380, DataType::F32, 3),
            87380 * 4 * 3
        );
        assert_eq!(data_bytes(Func::AllReduce, 25, DataType::F32, 3), 100);
    }

    #[test]
    fn header_and_row_match_nccl_tests_sample() {
        let r = row(8, 13.61, 13.22, 2);
        let table = format!("{}{}\n", header(false), format_row(&r));
        assert_eq!(table, SAMPLE);
    }

    #[test]
    fn row_columns() {
        // 1 GiB AllReduce on 8 ranks in 10000 us: algbw 107.37 GB/s, busbw ×1.75 = 187.90; in-place
        // in 5000 us: 214.75 and 375.81.
        let mut r = row(1 << 30, 10000.0, 5000.0, 8);
        r.in_place.as_mut().unwrap().wrong = Some(3);
        r.out_of_place.wrong = None;
        let line = format_row(&r);
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cols,
            [
                "1073741824",
                "268435456",
                "float",
                "sum",
                "-1",
                "10000",
                "107.37",
                "187.90",
                "N/A",
                "5000.0",
                "214.75",
                "375.81",
                "3"
            ]
        );
        assert_eq!(line.len(), 52 + 32 + 32);
        assert!(line.starts_with(
            "  1073741824     268435456     float     sum      -1    10000  107.37  187.90    N/A"
        ));

        r.nccl = Some(NcclCols {
            out_of_place: RefTiming {
                time_us: 10500.0,
                busbw: 182.43,
            },
            in_place: Some(RefTiming {
                time_us: 99.5,
                busbw: 17.0,
            }),
        });
        let line = format_row(&r);
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&cols[13..], ["10500", "182.43", "99.50", "17.00", "1.03"]);
        let hdr = header(true);
        let lines: Vec<&str> = hdr.lines().collect();
        assert_eq!(lines.len(), 3);
        // Every header column's right edge lines up with the row's.
        assert_eq!(lines[1].len(), line.len());
        assert_eq!(lines[2].len(), line.len());
        assert!(lines[0].ends_with("nccl out-of-place    nccl in-place"));
        assert!(lines[1].ends_with("time   busbw     time   busbw   ratio"));
        let edges = |s: &str| -> Vec<usize> {
            let b = s.as_bytes();
            (1..=b.len())
                .filter(|&i| b[i - 1] != b' ' && (i == b.len() || b[i] == b' '))
                .collect()
        };
        assert_eq!(edges(lines[1])[1..], edges(&line)[..]);
    }

    #[test]
    fn footer_lines() {
        let a = row(1 << 20, 10.0, 20.0, 2); // busbw 104.8576 and 52.4288
        let b = row(1 << 20, 1000.0, 1000.0, 2); // 1.048576 each
        let f = footer(&[a, b]);
        assert_eq!(
            f,
            "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 39.8459\n"
        );
        let mut c = b;
        c.in_place.as_mut().unwrap().wrong = Some(2);
        c.out_of_place.wrong = Some(1);
        c.nccl = Some(NcclCols {
            out_of_place: RefTiming {
                time_us: 900.0,
                busbw: 2.0,
            },
            in_place: Some(RefTiming {
                time_us: 900.0,
                busbw: 1.0,
            }),
        });
        let f = footer(&[a, c]);
        let lines: Vec<&str> = f.lines().collect();
        assert_eq!(lines[0], "# Out of bounds values : 3 FAILED");
        assert_eq!(lines[2], "# Avg NCCL bandwidth   : 1.5");
        assert_eq!(lines[3], "# Avg busbw ratio      : 0.70");
        assert_eq!(
            footer(&[]),
            "# Out of bounds values : 0 OK\n# Avg bus bandwidth    : 0\n"
        );
    }

    #[test]
    fn missing_in_place_prints_na_and_leaves_the_averages() {
        // An operation without an in-place form (AlltoAll): every in-place column N/A, in the
        // same widths; the averages and #wrong come from the out-of-place runs alone.
        let mut r = row(1 << 20, 10.0, 20.0, 2); // out-of-place busbw 104.8576
        r.in_place = None;
        r.out_of_place.wrong = Some(4);
        let line = format_row(&r);
        let full = format_row(&row(1 << 20, 10.0, 20.0, 2));
        assert_eq!(line.len(), full.len());
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(&cols[5..], ["10.00", "104.86", "104.86", "4", "N/A", "N/A", "N/A", "N/A"]);
        assert_eq!(total_wrong(&[r]), 4);
        assert_eq!(
            footer(&[r]),
            "# Out of bounds values : 4 FAILED\n# Avg bus bandwidth    : 104.858\n"
        );
        r.nccl = Some(NcclCols {
            out_of_place: RefTiming {
                time_us: 20.0,
                busbw: 52.0,
            },
            in_place: None,
        });
        let cols: Vec<String> = format_row(&r).split_whitespace().map(str::to_string).collect();
        assert_eq!(&cols[13..], ["20.00", "52.00", "N/A", "N/A", "2.02"]);
        assert!(footer(&[r]).contains("# Avg NCCL bandwidth   : 52\n"));
    }

    #[test]
    fn g_format() {
        assert_eq!(fmt_g(92.96451234), "92.9645");
        assert_eq!(fmt_g(0.0), "0");
        assert_eq!(fmt_g(1.5), "1.5");
        assert_eq!(fmt_g(100.0), "100");
        assert_eq!(fmt_g(123456.0), "123456");
        assert_eq!(fmt_g(1234567.0), "1.23457e+06");
        assert_eq!(fmt_g(0.0001234), "0.0001234");
        assert_eq!(fmt_g(0.00001234), "1.234e-05");
        assert_eq!(fmt_g(999999.7), "1e+06");
        assert_eq!(time_str(13.614), "  13.61");
        assert_eq!(time_str(123.45), "  123.5");
        assert_eq!(time_str(12345.6), "  12346");
    }
}
