// Headless check of MLflow UI addresses (issue 22; docs/pipeline.md, "The UI address"):
// each page in its own browser with a brand-new profile (empty localStorage), 1300x900
// viewport, wait for network idle + 5 s, full-page screenshot and document.body.innerText.
//   npm install puppeteer-core @sparticuz/chromium      (in a directory outside the repo)
//   LANG=en_US.UTF-8 node check.mjs http://127.0.0.1:PORT EXPERIMENT_ID OUT_DIR
// with `mlflow server` (or `make ui`) serving the pipeline's store on PORT.
import puppeteer from 'puppeteer-core';
import chromium from '@sparticuz/chromium';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';

const base = process.argv[2] || 'http://127.0.0.1:5077';
const exp = process.argv[3] || '1';
const out = process.argv[4] || 'ui-check';
fs.mkdirSync(out, { recursive: true });
const pages = [
  ['root', `${base}/`],
  ['runs', `${base}/#/experiments/${exp}/runs`],
  // extra, for comparison: the bare experiment address, and the runs address with the
  // sidebar's workflowType forced to model training
  ['experiment', `${base}/#/experiments/${exp}`],
  ['runs-ml', `${base}/#/experiments/${exp}/runs?workflowType=machine_learning`],
];

// @sparticuz/chromium's args are tuned for AWS Lambda; --single-process crashes on new
// targets here, so it is dropped. Each page gets its own browser with a brand-new
// user-data dir (a fresh profile: empty localStorage).
const args = [...chromium.args.filter(a => a !== '--single-process'), '--lang=en-US'];
const executablePath = await chromium.executablePath();
for (const [name, url] of pages) {
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), 'ui-check-profile-'));
  const browser = await puppeteer.launch({
    executablePath, args, userDataDir: profile, headless: 'shell',
    defaultViewport: { width: 1300, height: 900 },
  });
  console.log('browser', await browser.version(), 'profile', profile);
  const page = await browser.newPage();
  page.on('pageerror', e => console.log(`pageerror (${name}):`, String(e).slice(0, 300)));
  await page.setViewport({ width: 1300, height: 900 });
  await page.goto(url, { waitUntil: 'networkidle0', timeout: 120000 });
  await new Promise(r => setTimeout(r, 5000));
  await page.waitForNetworkIdle({ idleTime: 1000, timeout: 60000 }).catch(() => {});
  const text = await page.evaluate(() => document.body.innerText);
  const ls = await page.evaluate(() => JSON.stringify(Object.fromEntries(Object.entries(localStorage))));
  fs.writeFileSync(`${out}/${name}.txt`, `URL requested: ${url}\nURL after load: ${page.url()}\n` +
    `title: ${await page.title()}\n--- innerText ---\n${text}\n--- localStorage after load ---\n${ls}\n`);
  await page.screenshot({ path: `${out}/${name}.png`, fullPage: true });
  console.log(`== ${name}: ${url} -> ${page.url()}\n${text.slice(0, 1500)}\n`);
  await browser.close();
  fs.rmSync(profile, { recursive: true, force: true });
}
