// SPDX-License-Identifier: AGPL-3.0-only
// The web console in headless Chromium (Debian's), driven by playwright-core: a wrong key
// is refused, the right one logs in, the sandbox list shows the test's sandbox (its
// hostile label as text), a terminal runs `echo hi`, the files and events views load.
// Screenshots go to OUT_DIR; a JSON summary goes to stdout.
//
//   node console.mjs BASE_URL KEY SANDBOX_ID OUT_DIR
import { chromium } from "playwright-core";

const [base, key, sandbox, out] = process.argv.slice(2);
const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync"],
});
const result = { dialogs: [], errors: [], shots: [] };
try {
  const page = await browser.newPage({ viewport: { width: 1280, height: 800 } });
  page.on("dialog", async (d) => { result.dialogs.push(d.message()); await d.dismiss(); });
  page.on("pageerror", (e) => result.errors.push(String(e)));
  const shot = async (name) => {
    const path = `${out}/${name}.png`;
    await page.screenshot({ path, fullPage: false });
    result.shots.push(path);
  };
  await page.goto(`${base}/console`);
  await page.fill("#key", "dsk.not-a-key");
  await page.click("#login");
  await page.waitForFunction(() => document.querySelector("#login-error").textContent.length > 0);
  result.wrongKey = await page.textContent("#login-error");
  await shot("login-refused");

  await page.fill("#key", key);
  await page.click("#login");
  const row = `tr[data-id="${sandbox}"]`;
  await page.waitForSelector(row, { timeout: 20000 });
  result.rowText = await page.textContent(row);
  result.labelHtml = await page.$eval(`${row} .label`, (e) => e.innerHTML);
  await shot("sandboxes");

  await page.click(row);
  await page.waitForSelector("#terminal[data-pid]", { timeout: 20000 });
  await page.waitForFunction(() => /[$#]\s*$/m.test(document.querySelector(".xterm-rows").innerText), null, { timeout: 20000 });
  await page.click("#terminal");
  await page.keyboard.type("echo hi; uname -s\n");
  await page.waitForFunction(() => /^hi\s*$/m.test(document.querySelector(".xterm-rows").innerText), null, { timeout: 20000 });
  result.terminal = await page.$eval(".xterm-rows", (e) => e.innerText);
  await shot("terminal");

  await page.click('button[data-tab="files"]');
  await page.waitForSelector('tr[data-id="/etc"]', { timeout: 20000 });
  await page.click('tr[data-id="/etc"]');
  await page.waitForSelector('tr[data-id="/etc/passwd"]', { timeout: 20000 });
  result.cwd = await page.textContent("#cwd");
  await shot("files");

  // Each view replaces the last one's table: wait for this view's own rows.
  const rowWith = (text) => page.waitForFunction(
    (t) => [...document.querySelectorAll("tbody tr")].some((r) => r.innerText.includes(t)), text, { timeout: 20000 });
  await page.click('button[data-tab="processes"]');
  await rowWith("console");
  result.processes = await page.$$eval("tbody tr", (rs) => rs.map((r) => r.innerText));
  await shot("processes");

  await page.click('a[data-view="events"]');
  await page.waitForFunction((id) => [...document.querySelectorAll("td")].some((t) => t.textContent === id), sandbox, { timeout: 20000 });
  result.events = await page.$$eval("tbody tr", (rs) => rs.map((r) => r.innerText));
  await shot("events");

  await page.click('a[data-view="projects"]');
  await rowWith("root/console-");
  await shot("projects");
  result.csp = (await (await fetch(`${base}/console`)).headers.get("content-security-policy")) || "";
} catch (e) {
  result.failure = String(e && e.stack || e);
  // What the page showed when it failed, for the test's message.
  try {
    const page = browser.contexts()[0].pages()[0];
    await page.screenshot({ path: `${out}/failure.png` });
    result.failureText = await page.evaluate(() => document.body.innerText);
  } catch (_) { /* the page is gone */ }
} finally {
  await browser.close();
}
console.log(JSON.stringify(result));
