// A small line of a slot's recent samples (0-100 %), drawn with uPlot without axes or legend.
import { useEffect, useRef } from "react";
import uPlot from "uplot";

export default function Sparkline({ xs, ys, width = 110, height = 26, color = "#2457c5", label }) {
  const box = useRef(null);
  const plot = useRef(null);
  const latest = useRef([xs, ys]);
  latest.current = [xs, ys];

  useEffect(() => {
    const u = new uPlot(
      {
        width,
        height,
        pxAlign: false,
        cursor: { show: false },
        select: { show: false },
        legend: { show: false },
        padding: [2, 0, 2, 0],
        scales: { x: { time: false }, y: { auto: false, range: [0, 100] } },
        axes: [{ show: false }, { show: false }],
        series: [{}, { stroke: color, width: 1.25, fill: `${color}22`, spanGaps: true, points: { show: false } }],
      },
      latest.current,
      box.current,
    );
    plot.current = u;
    return () => {
      u.destroy();
      plot.current = null;
    };
  }, [width, height, color]);

  useEffect(() => {
    plot.current?.setData([xs, ys]);
  }, [xs, ys]);

  return <span className="sparkline" ref={box} role="img" aria-label={label} data-samples={ys.length} />;
}
