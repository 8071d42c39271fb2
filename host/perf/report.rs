//! Machine-readable and graphical reports of a sweep: `oxccl perf --json FILE` and
//! `--plot FILE` (an SVG of busbw against message size, one curve per collective and backend).
use super::table::{Measure, Row};
use serde_json::{Value, json};

/// The rows of one operation's sweep.
pub struct Sweep<'a> {
    /// The operation as nccl-tests names its benchmark: a collective's `Func::name()`
    /// (`allreduce`) or a point-to-point operation's `P2pFunc::name()` (`sendrecv`).
    pub name: &'a str,
    pub rows: &'a [Row],
}

fn measure(m: Option<&Measure>) -> Value {
    match m {
        Some(m) => {
            json!({ "time_us": m.time_us, "algbw_gbs": m.algbw, "busbw_gbs": m.busbw, "wrong": m.wrong })
        }
        None => Value::Null,
    }
}

/// The JSON document of `--json`: `meta` (free-form run description) and, per operation, every
/// row with out-of-place and in-place measurements (times in µs, bandwidths in GB/s of 1e9 B,
/// `wrong` null when unchecked, `in_place` null where the operation has no in-place form) and
/// NCCL's when compared.
pub fn to_json(meta: Value, sweeps: &[Sweep<'_>]) -> String {
    let results: Vec<Value> = sweeps
        .iter()
        .flat_map(|s| {
            s.rows.iter().map(move |r| {
                json!({
                    "collective": s.name,
                    "size_bytes": r.bytes,
                    "count": r.count,
                    "dtype": r.dtype.name(),
                    "redop": r.redop.map(|o| o.name()),
                    "root": r.root,
                    "out_of_place": measure(Some(&r.out_of_place)),
                    "in_place": measure(r.in_place.as_ref()),
                    "nccl": r.nccl.map(|n| json!({
                        "out_of_place": { "time_us": n.out_of_place.time_us, "busbw_gbs": n.out_of_place.busbw },
                        "in_place": n.in_place.map(|t| json!({ "time_us": t.time_us, "busbw_gbs": t.busbw })),
                    })),
                    "ratio_busbw_out_of_place": r.ratio(),
                    "choice": r.choice.map(|c| json!({
                        "algo": c.algo.name(),
                        "proto": c.proto.name(),
                        "nchannels": c.nchannels,
                    })),
                })
            })
        })
        .collect();
    let doc = json!({ "meta": meta, "results": results });
    serde_json::to_string_pretty(&doc).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
}

const COLORS: [&str; 5] = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e"];

fn fmt_size(b: u64) -> String {
    match b {
        b if b >= 1 << 30 => format!("{}G", b >> 30),
        b if b >= 1 << 20 => format!("{}M", b >> 20),
        b if b >= 1 << 10 => format!("{}K", b >> 10),
        b => format!("{b}"),
    }
}

/// An SVG plot of out-of-place busbw (GB/s) against message size (log scale): a solid curve per
/// collective for oxccl and a dashed one for the reference where compared, named `reference`
/// ("NCCL"). `title` heads the plot.
pub fn svg_plot(title: &str, sweeps: &[Sweep<'_>], reference: &str) -> String {
    let (w, h, ml, mr, mt, mb) = (900.0, 520.0, 70.0, 180.0, 40.0, 50.0);
    let pts: Vec<(u64, f64)> = sweeps
        .iter()
        .flat_map(|s| s.rows.iter())
        .filter(|r| r.bytes > 0)
        .flat_map(|r| {
            let n = r.nccl.map(|n| n.out_of_place.busbw);
            std::iter::once((r.bytes, r.out_of_place.busbw)).chain(n.map(|b| (r.bytes, b)))
        })
        .collect();
    let (xmin, xmax) = pts.iter().fold((f64::MAX, f64::MIN), |(a, b), p| {
        let x = (p.0 as f64).log2();
        (a.min(x), b.max(x))
    });
    let ymax = pts.iter().map(|p| p.1).fold(1.0f64, f64::max) * 1.08;
    let xspan = if xmax > xmin { xmax - xmin } else { 1.0 };
    let px = |b: u64| ml + ((b as f64).log2() - xmin) / xspan * (w - ml - mr);
    let py = |v: f64| mt + (1.0 - v / ymax) * (h - mt - mb);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{ml}\" y=\"22\" font-size=\"15\">{}</text>\n",
        xml_escape(title)
    );
    // Axes, grid and labels.
    let decimals = if ymax >= 50.0 {
        0
    } else if ymax >= 5.0 {
        1
    } else {
        2
    };
    for i in 0..=5 {
        let v = ymax * i as f64 / 5.0;
        let y = py(v);
        s += &format!(
            "<line x1=\"{ml}\" y1=\"{y:.1}\" x2=\"{:.1}\" y2=\"{y:.1}\" stroke=\"#ddd\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{v:.decimals$}</text>\n",
            w - mr,
            ml - 6.0,
            y + 4.0
        );
    }
    let mut sizes: Vec<u64> = pts.iter().map(|p| p.0).collect();
    sizes.sort_unstable();
    sizes.dedup();
    for b in &sizes {
        let x = px(*b);
        s += &format!(
            "<text x=\"{x:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{}</text>\n",
            h - mb + 18.0,
            fmt_size(*b)
        );
    }
    s += &format!(
        "<line x1=\"{ml}\" y1=\"{:.1}\" x2=\"{:.1}\" y2=\"{:.1}\" stroke=\"black\"/><line x1=\"{ml}\" y1=\"{mt}\" x2=\"{ml}\" y2=\"{:.1}\" stroke=\"black\"/>\n\
         <text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">message size (bytes)</text>\n\
         <text x=\"16\" y=\"{:.1}\" transform=\"rotate(-90 16 {:.1})\" text-anchor=\"middle\">busbw (GB/s)</text>\n",
        h - mb,
        w - mr,
        h - mb,
        h - mb,
        (ml + w - mr) / 2.0,
        h - 10.0,
        (mt + h - mb) / 2.0,
        (mt + h - mb) / 2.0
    );
    let mut legend_y = mt + 10.0;
    for (i, sw) in sweeps.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let rows: Vec<&Row> = sw.rows.iter().filter(|r| r.bytes > 0).collect();
        let line = |f: &dyn Fn(&Row) -> Option<f64>| -> String {
            rows.iter()
                .filter_map(|r| f(r).map(|v| format!("{:.1},{:.1}", px(r.bytes), py(v))))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let curves: [(&str, &str, String); 2] = [
            ("oxccl", "", line(&|r| Some(r.out_of_place.busbw))),
            (
                reference,
                " stroke-dasharray=\"6,4\"",
                line(&|r| r.nccl.map(|n| n.out_of_place.busbw)),
            ),
        ];
        for (who, dash, points) in curves {
            if points.is_empty() {
                continue;
            }
            s += &format!(
                "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{dash} points=\"{points}\"/>\n\
                 <line x1=\"{:.1}\" y1=\"{legend_y:.1}\" x2=\"{:.1}\" y2=\"{legend_y:.1}\" stroke=\"{color}\" stroke-width=\"2\"{dash}/>\
                 <text x=\"{:.1}\" y=\"{:.1}\">{} {who}</text>\n",
                w - mr + 10.0,
                w - mr + 40.0,
                w - mr + 46.0,
                legend_y + 4.0,
                xml_escape(sw.name)
            );
            legend_y += 18.0;
        }
    }
    s += "</svg>\n";
    s
}

fn xml_escape(t: &str) -> String {
    t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::table::{NcclCols, RefTiming};
    use oxccl_gpu::abi::{DataType, RedOp};

    fn row(bytes: u64, busbw: f64, nccl: Option<f64>) -> Row {
        let m = Measure {
            time_us: 10.0,
            algbw: busbw,
            busbw,
            wrong: Some(0),
        };
        Row {
            bytes,
            count: (bytes / 4) as usize,
            dtype: DataType::F32,
            redop: Some(RedOp::Sum),
            root: -1,
            out_of_place: m,
            in_place: Some(m),
            choice: None,
            nccl: nccl.map(|b| NcclCols {
                out_of_place: RefTiming {
                    time_us: 12.0,
                    busbw: b,
                },
                in_place: Some(RefTiming {
                    time_us: 12.0,
                    busbw: b,
                }),
            }),
        }
    }

    #[test]
    fn json_holds_every_row_with_units() {
        let rows = [row(8, 0.5, Some(0.4)), row(1 << 20, 100.0, Some(80.0))];
        let text = to_json(
            json!({"nranks": 2}),
            &[Sweep {
                name: "allreduce",
                rows: &rows,
            }],
        );
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["meta"]["nranks"], 2);
        let r = &v["results"][1];
        assert_eq!(r["collective"], "allreduce");
        assert_eq!(r["size_bytes"], 1 << 20);
        assert_eq!(r["out_of_place"]["busbw_gbs"], 100.0);
        assert_eq!(r["nccl"]["out_of_place"]["busbw_gbs"], 80.0);
        assert_eq!(r["ratio_busbw_out_of_place"], 1.25);
        assert_eq!(v["results"].as_array().unwrap().len(), 2);
        // No in-place form (AlltoAll): null, not a zero measurement.
        let mut r = rows[0];
        r.in_place = None;
        r.nccl.as_mut().unwrap().in_place = None;
        let sweep = Sweep {
            name: "alltoall",
            rows: &[r],
        };
        let v: Value = serde_json::from_str(&to_json(json!({}), &[sweep])).unwrap();
        assert_eq!(v["results"][0]["collective"], "alltoall");
        assert!(v["results"][0]["in_place"].is_null());
        assert!(v["results"][0]["nccl"]["in_place"].is_null());
        assert_eq!(v["results"][0]["out_of_place"]["wrong"], 0);
    }

    #[test]
    fn svg_has_a_curve_per_backend_and_labels() {
        let rows = [
            row(8, 0.5, Some(0.4)),
            row(1 << 20, 100.0, Some(80.0)),
            row(1 << 30, 300.0, Some(310.0)),
        ];
        let svg = svg_plot(
            "t <x>",
            &[Sweep {
                name: "allgather",
                rows: &rows,
            }],
            "NCCL",
        );
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert_eq!(
            svg.matches("stroke-dasharray").count(),
            2,
            "NCCL curve and its legend are dashed"
        );
        assert!(svg.contains("allgather oxccl") && svg.contains("allgather NCCL"));
        assert!(svg.contains(">1G<") && svg.contains(">1M<") && svg.contains("t &lt;x&gt;"));
        // The highest busbw sits highest (smallest y) on the oxccl curve.
        let pts: Vec<f64> = svg
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap()
            .split(' ')
            .map(|p| p.split(',').nth(1).unwrap().parse().unwrap())
            .collect();
        assert!(pts[2] < pts[1] && pts[1] < pts[0]);
    }
}
