"""The web console (`deltamesh console`): one mesh on one page, read server side from its gateways,
pools, broker and trainers with the console's own credentials; the browser gets HTML, the console's
own JavaScript and CSS, and data, never a credential (docs/CONSOLE.md)."""
