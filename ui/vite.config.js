// Vite: the dashboard's dev server, production build (ui/dist, served by `zwdx server`) and Vitest.
import { defineConfig } from "vite";
import react from "@vitejs/plugin-react";

// `npm run dev` proxies the API and Socket.IO to a running zwdx server (default: the standard port).
const server = process.env.ZWDX_SERVER_URL || "http://127.0.0.1:4461";

export default defineConfig({
  plugins: [react()],
  server: {
    port: 5173,
    proxy: {
      "/api": server,
      "/health": server,
      "/socket.io": { target: server, ws: true },
    },
  },
  build: { outDir: "dist", emptyOutDir: true },
  test: {
    environment: "jsdom",
    setupFiles: ["./src/test/setup.js"],
    include: ["src/**/*.test.{js,jsx}"],
    allowOnly: false, // a `.only` fails the run, on a laptop as in CI (src/test/no-skips.test.js: skip, todo)
  },
});
