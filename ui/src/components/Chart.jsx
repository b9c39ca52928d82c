// A live line chart (uPlot): one line per rank. New data is pushed with setData, so a growing
// series redraws without rebuilding the chart.
import { useEffect, useRef } from "react";
import uPlot from "uplot";
import "uplot/dist/uPlot.min.css";

export const COLORS = ["#2457c5", "#d9480f", "#2b8a3e", "#862e9c", "#c92a2a", "#0b7285", "#e67700", "#5c940d"];

export default function Chart({ title, data, labels, xLabel = "step", height = 200, testId }) {
  const box = useRef(null);
  const plot = useRef(null);
  const latest = useRef(data);
  latest.current = data;
  const key = labels.join("|");

  useEffect(() => {
    const el = box.current;
    const opts = {
      width: Math.max(el.clientWidth, 200),
      height,
      scales: { x: { time: false } },
      legend: { show: labels.length > 1 },
      axes: [
        { label: xLabel, labelSize: 18, size: 34, stroke: "#555" },
        { size: 56, stroke: "#555" },
      ],
      series: [
        { label: xLabel },
        ...labels.map((label, i) => ({ label, stroke: COLORS[i % COLORS.length], width: 1.75, spanGaps: false })),
      ],
    };
    const u = new uPlot(opts, latest.current, el);
    plot.current = u;
    const resize = new ResizeObserver(() => u.setSize({ width: Math.max(el.clientWidth, 200), height }));
    resize.observe(el);
    return () => {
      resize.disconnect();
      u.destroy();
      plot.current = null;
    };
  }, [key, xLabel, height]); // eslint-disable-line react-hooks/exhaustive-deps

  useEffect(() => {
    plot.current?.setData(data);
  }, [data]);

  const points = data.slice(1).reduce((n, ys) => n + ys.filter((v) => v != null).length, 0);
  return (
    <figure className="chart" data-testid={testId} data-points={points}>
      <figcaption>{title}</figcaption>
      <div ref={box} className="chart-canvas" />
    </figure>
  );
}
