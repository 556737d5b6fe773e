// Drives the dashboard in headless Chromium for tests/dashboard.rs:
//   node check.cjs URL SCREENSHOT PLAN_JSON
// Prints one line per stage on stdout; the test answers on stdin. Stages: "canary ok" (the
// console-error collector catches an error planted in a page of its own), "nodes N/M" (the page
// shows every node up), "kill?" (the test kills a node and writes "killed"), "down" (the page
// shows one fewer node up), then the planner is filled from PLAN_JSON and "plan {...}" printed
// with what the page answered; the screenshot is taken last. Exits non-zero on any console error
// or failed wait, printing why.
"use strict";
const { chromium } = require("playwright-core");
const readline = require("readline");

const [url, screenshot, planJson] = process.argv.slice(2);
const input = readline.createInterface({ input: process.stdin });
const lines = input[Symbol.asyncIterator]();
const say = (line) => process.stdout.write(line + "\n");

async function main() {
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync"],
  });
  try {
    const errors = [];
    const watch = (page) => {
      page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
      page.on("pageerror", (e) => errors.push(String(e)));
    };

    // The canary: the collector must see an error thrown by a page.
    const canary = await browser.newPage();
    watch(canary);
    await canary.setContent("<script>throw new Error('planted canary error')</script>");
    await canary.waitForTimeout(200);
    if (!errors.some((e) => e.includes("planted canary error"))) {
      throw new Error("the console-error collector missed the planted error");
    }
    errors.length = 0;
    await canary.close();
    say("canary ok");

    const page = await browser.newPage({ viewport: { width: 1400, height: 1100 } });
    watch(page);
    await page.goto(url);
    await page.waitForFunction(() => {
      const t = document.getElementById("node-count").textContent;
      const m = t.match(/^(\d+) \/ (\d+)$/);
      return m && m[1] === m[2] && Number(m[2]) >= 2;
    }, null, { timeout: 60000 });
    const before = await page.textContent("#node-count");
    const rows = await page.$$eval("#nodes tbody tr", (r) => r.map((x) => x.dataset.addr));
    const members = await page.$$eval("#members tbody tr", (r) => r.length);
    say(`nodes ${before.replace(" / ", "/")} rows ${rows.join(",")} members ${members}`);

    say("kill?");
    const answer = await lines.next();
    if (answer.done || answer.value.trim() !== "killed") throw new Error("no kill confirmation");
    await page.waitForFunction((was) => {
      const m = document.getElementById("node-count").textContent.match(/^(\d+) \/ (\d+)$/);
      return m && Number(m[1]) === Number(was) - 1;
    }, before.split(" / ")[0], { timeout: 60000 });
    say(`down ${(await page.textContent("#node-count")).replace(" / ", "/")}`);

    const plan = JSON.parse(planJson);
    await page.selectOption("#plan-profile", plan.profile);
    await page.fill("#plan-rate", String(plan.rate));
    await page.fill("#plan-prompt", String(plan.prompt_tokens));
    await page.fill("#plan-output", String(plan.output_tokens));
    await page.fill("#plan-prefix", "0");
    await page.click("#plan-submit");
    await page.waitForSelector("#plan-nodes", { timeout: 20000 });
    const nodes = Number(await page.textContent("#plan-nodes"));
    const verdict = await page.textContent("#plan-verdict");
    const sources = await page.$$eval("#plan-sources tbody tr", (r) => r.map((x) => x.cells[2].textContent));
    say("plan " + JSON.stringify({ nodes, verdict, sources }));

    await page.screenshot({ path: screenshot, fullPage: true });
    if (errors.length) throw new Error("console errors: " + errors.join(" | "));
    say("done");
  } finally {
    await browser.close();
    input.close();
  }
}

main().catch((e) => { say("FAILED " + e.message); process.exit(1); });
