import { defineConfig } from "vite";

// Flask serves dist/index.html at /pay/<intent_id> and dist/assets/* at /pay/assets/*.
export default defineConfig({
  base: "/pay/",
  build: {
    outDir: "dist",
    assetsDir: "assets",
    emptyOutDir: true,
    target: "es2020",
    sourcemap: false,
  },
});
